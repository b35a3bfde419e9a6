"""Engine configuration: the one place defaults live.

`EngineArgs` holds the user-facing knobs (CLI flags and `LLM(**kwargs)` keywords) and
turns them into frozen config dataclasses once the model is known.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
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
    dtype: str  # "float32" | "bfloat16" | "float16"

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V, over all layers, that one token occupies in the pool."""
        itemsize = jax.numpy.dtype(self.dtype).itemsize
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache geometry."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int = 0  # physical blocks in the pool, block 0 (the null block) included
    enable_prefix_caching: bool = False
    num_host_blocks: int = 0  # host-memory blocks that swap preemption moves requests' blocks to


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits."""

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    preemption_mode: Literal["recompute", "swap"] = "recompute"


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
    attention_backend: str = "reference"  # resolved: "pallas", "pallas-interpret" or "reference"
    sampler_backend: str = "reference"  # resolved, as attention_backend
    share_forked_blocks: bool = True  # n > 1 siblings and beams share blocks (copy-on-write)


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


def platform_is_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda", "rocm")


KERNEL_BACKENDS = ("auto", "pallas", "reference")


def resolve_kernel_backend(name: str) -> str:
    """auto: the Pallas kernel on GPU, the plain-JAX path elsewhere; pallas off GPU runs the interpreter."""
    if name == "auto":
        name = "pallas" if platform_is_gpu() else "reference"
    if name == "pallas" and not platform_is_gpu():
        return "pallas-interpret"
    return name


@dataclass
class EngineArgs:
    """User-facing engine options; each field is a CLI flag (`--block-size`) and an `LLM` keyword."""

    model: str | None = None  # None: the default SmolLM2-135M-Instruct GGUF
    tokenizer: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on GPU, float32 on CPU
    seed: int = 0
    block_size: int = DEFAULT_BLOCK_SIZE
    num_kv_blocks: int | None = None  # overrides the memory budget (vLLM's num_gpu_blocks_override)
    kv_cache_memory: int | str | None = None  # bytes for the KV pool; default: fraction of free memory
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_FRACTION
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"
    compile_guard: bool = False
    logprobs_mode: str = "raw_logprobs"  # logprobs from the raw model output, or "processed_logprobs"
    attention_backend: str = "auto"  # auto (Pallas on GPU), pallas (interpreted off GPU: slow), reference
    sampler_backend: str = "auto"  # auto (Pallas on GPU), pallas (interpreted off GPU: slow), reference
    # n > 1 samples fork from one prefilled prompt and beams fork from their parent, sharing blocks with
    # copy-on-write. Off (for measuring what sharing saves): samples prefill on their own and beams fork
    # by copying every block.
    share_forked_blocks: bool = True
    preemption_mode: str = "recompute"  # or "swap": preempted requests' blocks go to host memory and back
    swap_space: float = 4.0  # GiB of host memory for swapped blocks (with preemption_mode=swap)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "num_kv_blocks"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or v <= 0):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ValueError(f"logprobs_mode must be raw_logprobs or processed_logprobs, got {self.logprobs_mode!r}")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}")
        if not isinstance(self.swap_space, (int, float)) or self.swap_space < 0:
            raise ValueError(f"swap_space must be a non-negative number of GiB, got {self.swap_space!r}")
        for name in ("attention_backend", "sampler_backend"):
            if getattr(self, name) not in KERNEL_BACKENDS:
                raise ValueError(f"{name} must be one of {', '.join(KERNEL_BACKENDS)}; got {getattr(self, name)!r}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_cache_memory is not None:
            parse_bytes(self.kv_cache_memory)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "bfloat16" if platform_is_gpu() else "float32"

    def scheduler_config(self, model_max_len: int) -> SchedulerConfig:
        gpu = platform_is_gpu()
        max_model_len = self.max_model_len or model_max_len
        if max_model_len > model_max_len:
            raise ValueError(f"max_model_len {max_model_len} exceeds the model's context length {model_max_len}")
        max_tokens = self.max_num_batched_tokens or (2048 if gpu else 1024)
        if not self.enable_chunked_prefill:
            max_tokens = max(max_tokens, max_model_len)
        return SchedulerConfig(
            max_num_seqs=self.max_num_seqs or (256 if gpu else 64),
            max_num_batched_tokens=max_tokens,
            max_model_len=max_model_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            preemption_mode=self.preemption_mode,
            policy=self.scheduling_policy,  # type: ignore[arg-type]
        )

    @classmethod
    def add_cli_args(cls, parser) -> None:
        """Add one `--flag` per field (booleans as --x / --no-x) to an argparse parser."""
        import argparse

        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            default = f.default
            if isinstance(default, bool):
                parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
            elif f.name == "preemption_mode":
                parser.add_argument(flag, choices=("recompute", "swap"), default=default,
                                    help="swap: preempted requests' blocks go to host memory (--swap-space GiB)")
            elif f.name in ("attention_backend", "sampler_backend"):
                parser.add_argument(flag, choices=KERNEL_BACKENDS, default=default,
                                    help="auto: the Pallas kernel on GPU, the plain-JAX path elsewhere")
            elif f.name == "kv_cache_memory":
                parser.add_argument(flag, default=None, help="KV pool size, e.g. 4GiB (default: 4GiB on CPU, "
                                    "gpu_memory_utilization of free memory on GPU)")
            else:
                kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0].replace("|", "").strip(), str)
                parser.add_argument(flag, type=kind, default=default)

    @classmethod
    def from_cli_args(cls, ns) -> EngineArgs:
        return cls(**{name: getattr(ns, name) for name in cls.field_names() if hasattr(ns, name)})

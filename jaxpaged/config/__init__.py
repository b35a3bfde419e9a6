"""The ground floor: every config an engine is built from, its defaults, and the user's flags.

`engine_config.py` the frozen model/cache/scheduler/engine configs, `engine_args.py` `EngineArgs` (each field a
CLI flag and an `LLM` keyword), `buckets.py` the token buckets a step is padded to, `speculative.py`
`SpeculativeConfig`. Nothing here imports the rest of jaxpaged.
"""

from jaxpaged.config.buckets import pick_token_bucket, seq_bucket, token_buckets
from jaxpaged.config.engine_args import (
    DTYPES,
    KV_ROLES,
    LOAD_FORMATS,
    LOGPROBS_MODES,
    PREEMPTION_MODES,
    SCHEDULING_POLICIES,
    EngineArgs,
    check_multihost_args,
)
from jaxpaged.config.engine_config import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_MEMORY_FRACTION,
    KERNEL_BACKENDS,
    KV_CACHE_DTYPES,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    SchedulerConfig,
    fine_token_buckets_for,
    kv_pool_dtype,
    parse_bytes,
    platform_is_gpu,
    resolve_attention_backend,
    resolve_kernel_backend,
)
from jaxpaged.config.speculative import SpeculativeConfig

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_BLOCK_SIZE", "DEFAULT_CPU_KV_CACHE_BYTES", "DEFAULT_GPU_MEMORY_FRACTION", "DTYPES", "KERNEL_BACKENDS", "KV_CACHE_DTYPES", "KV_ROLES", "LOAD_FORMATS", "LOGPROBS_MODES", "PREEMPTION_MODES", "SCHEDULING_POLICIES", "CacheConfig", "EngineArgs", "EngineConfig", "ModelConfig", "SchedulerConfig", "SpeculativeConfig", "check_multihost_args", "fine_token_buckets_for", "kv_pool_dtype", "parse_bytes", "pick_token_bucket", "platform_is_gpu", "resolve_attention_backend", "resolve_kernel_backend", "seq_bucket", "token_buckets"]

"""The ground floor: every config an engine is built from, its defaults, and the user's flags.

`engine_config.py` the frozen model/cache/scheduler/engine configs the engine is built from (the user's flags,
`EngineArgs`, live with the engine: `engine/arg_utils.py`), `buckets.py` the token buckets a step is padded to, `speculative.py`
`SpeculativeConfig`. Nothing here imports the rest of jaxpaged.
"""

from jaxpaged.config.buckets import pick_token_bucket, seq_bucket, token_buckets
from jaxpaged.config.engine_config import (
    ATTENTION_BACKENDS,
    DEFAULT_BLOCK_SIZE,
    DEFAULT_CPU_KV_CACHE_BYTES,
    DEFAULT_GPU_MEMORY_FRACTION,
    DTYPES,
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
)
from jaxpaged.config.lora import LoRAConfig
from jaxpaged.config.speculative import SpeculativeConfig

__all__ = ["ATTENTION_BACKENDS", "DEFAULT_BLOCK_SIZE", "DEFAULT_CPU_KV_CACHE_BYTES", "DEFAULT_GPU_MEMORY_FRACTION", "DTYPES", "KERNEL_BACKENDS", "KV_CACHE_DTYPES", "CacheConfig", "EngineConfig", "LoRAConfig", "ModelConfig", "SchedulerConfig", "SpeculativeConfig", "fine_token_buckets_for", "kv_pool_dtype", "parse_bytes", "pick_token_bucket", "platform_is_gpu", "seq_bucket", "token_buckets"]

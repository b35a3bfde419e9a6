"""How many KV blocks the pool gets: an explicit count, a byte budget, or a fraction of free memory."""

from __future__ import annotations

import logging

import jax

from jaxpaged.config import (
    DEFAULT_CPU_KV_CACHE_BYTES,
    ModelConfig,
    parse_bytes,
    platform_is_gpu,
)
from jaxpaged.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)


def free_device_memory(param_bytes: int) -> int | None:
    """Bytes free on the first device after params, or None where the backend does not say (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    limit = stats.get("bytes_limit")
    if not limit:
        return None
    return int(limit) - int(stats.get("bytes_in_use", param_bytes))


def num_kv_blocks(args: EngineArgs, model_config: ModelConfig, block_size: int, param_bytes: int,
                  draft_config: ModelConfig | None = None) -> int:
    """Physical blocks for the pool (block 0, the null block, included), logged with where it came from.
    With a draft model, each block also holds the draft's KV (a pool of its own, same block ids)."""
    per_block = sum(c.kv_bytes_per_token(args.resolved_kv_dtype()) * block_size
                    for c in (model_config, draft_config) if c is not None)
    if args.num_kv_blocks is not None:
        n, source = args.num_kv_blocks, "num_kv_blocks"
    else:
        if args.kv_cache_memory is not None:
            budget, source = parse_bytes(args.kv_cache_memory), "kv_cache_memory"
        elif platform_is_gpu() and (free := free_device_memory(param_bytes)) is not None:
            # (tensor parallelism: each device holds 1 / tp of every block)
            budget = int(free * args.gpu_memory_utilization) * args.tensor_parallel_size
            source = f"{args.gpu_memory_utilization:.0%} of free device memory"
            if args.tensor_parallel_size > 1:
                source += f" on each of {args.tensor_parallel_size} devices"
        else:
            budget, source = DEFAULT_CPU_KV_CACHE_BYTES, "default CPU budget"
        if args.data_parallel_size > 1 and not platform_is_gpu():  # one host's memory for every replica's pool
            budget //= args.data_parallel_size
            source += f", shared by {args.data_parallel_size} replicas"
        n = budget // per_block
    if n < 2:
        raise ValueError(f"the KV cache budget ({source}) gives {n} blocks; at least 2 are needed")
    logger.info(
        "KV cache: %d blocks x %d tokens = %d tokens, %s, %.2f GiB (%s)",
        n, block_size, (n - 1) * block_size, args.resolved_kv_dtype(), n * per_block / 2**30, source,
    )
    return n


def num_host_blocks(args: EngineArgs, model_config: ModelConfig, block_size: int) -> int:
    """Host-memory blocks for swap preemption: swap_space GiB of them with preemption_mode=swap, else 0."""
    if args.preemption_mode != "swap":
        return 0
    n = int(args.swap_space * 2**30) // (model_config.kv_bytes_per_token(args.resolved_kv_dtype()) * block_size)
    logger.info("Swap space: %d host blocks (%.2f GiB)", n, args.swap_space)
    return n


def offload_settings(args: EngineArgs, model_config: ModelConfig, max_model_len: int) -> dict:
    """CacheConfig's offload fields: host blocks, folder, disk budget and the model identity files carry."""
    n = num_offload_host_blocks(args, model_config, args.block_size, max_model_len)
    if not args.kv_offload_dir:
        return {"offload_host_blocks": n}
    from jaxpaged.kv_offload.identity import model_identity
    from jaxpaged.models.kv_scales import is_fp8

    kv_dtype = args.resolved_kv_dtype()
    identity = model_identity(model_config, load_format=args.load_format, kv_dtype=kv_dtype,
                              block_size=args.block_size, kv_scales=is_fp8(kv_dtype) and args.calculate_kv_scales)
    return {"offload_host_blocks": n, "offload_dir": args.kv_offload_dir,
            "offload_disk_bytes": int(args.kv_offload_disk_gb * 2**30), "offload_identity": identity}


def num_offload_host_blocks(args: EngineArgs, model_config: ModelConfig, block_size: int, max_model_len: int) -> int:
    """Host-memory blocks of the offload tier: kv_offload_host_gb GiB of them; with a disk tier at least one
    longest sequence's worth (disk reads stage through host memory); 0 when offload is off."""
    if not (args.kv_offload_host_gb or args.kv_offload_dir):
        return 0
    per_block = model_config.kv_bytes_per_token(args.resolved_kv_dtype()) * block_size
    n = int(args.kv_offload_host_gb * 2**30) // per_block
    if args.kv_offload_dir:
        n = max(n, -(-max_model_len // block_size))
    disk = f"; disk tier in {args.kv_offload_dir} up to {args.kv_offload_disk_gb:g} GiB" if args.kv_offload_dir else ""
    logger.info("KV offload: %d host blocks (%.2f GiB)%s", n, n * per_block / 2**30, disk)
    return n

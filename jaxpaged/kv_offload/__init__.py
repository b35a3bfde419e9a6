"""Host-memory and disk tiers behind the prefix cache: blocks the device pool evicts live on there, keyed by
the same chained block hash, and come back instead of being recomputed."""

from jaxpaged.kv_offload.disk_tier import DiskTier
from jaxpaged.kv_offload.host_tier import HostTier
from jaxpaged.kv_offload.offload import KVOffload

__all__ = ["DiskTier", "HostTier", "KVOffload"]

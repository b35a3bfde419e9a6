"""`KVOffload`: what the KV cache manager and the runner share of the tiers.

The manager decides: a cached block the device pool evicts is stored to a host slot (`stores`), and a prompt
whose next block hashes miss on the device but hit a tier gets fresh device blocks loaded from host slots
(`loads`; a disk hit is read into a host slot first, at lookup). Both travel in the `SchedulerOutput`; the
runner executes them, stores before anything else (the evicted block is about to be overwritten) and loads
after everything else, then hands stored blocks on to the disk tier.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from jaxpaged.config import EngineConfig
from jaxpaged.kv_offload.disk_tier import DiskTier
from jaxpaged.kv_offload.host_tier import HostTier


@dataclass
class OffloadCounters:
    """Running totals (blocks and bytes) of what the tiers did."""

    host_hit_blocks: int = 0
    disk_hit_blocks: int = 0
    stored_blocks: int = 0  # device -> host
    loaded_blocks: int = 0  # host -> device


class KVOffload:
    """The host tier (and, optionally, the disk tier behind it) of one engine."""

    def __init__(self, host: HostTier, disk: DiskTier | None = None):
        self.host = host
        self.disk = disk
        self.stores: list[tuple[int, int]] = []  # (device block, host slot), this schedule
        self.loads: list[tuple[int, int]] = []  # (host slot, device block), this schedule
        self.counters = OffloadCounters()
        self._from_disk: set[int] = set()  # slots a disk read filled this schedule

    @classmethod
    def for_engine(cls, config: EngineConfig) -> KVOffload:
        """The host tier (and the disk tier, with a folder) for the engine's pool: its block shape and dtype."""
        mc, cc = config.model_config, config.cache_config
        shape = (mc.num_layers, 2, cc.block_size, mc.num_kv_heads, mc.head_dim)
        dtype = jnp.dtype(cc.dtype)
        disk = None
        if cc.offload_dir:
            disk = DiskTier(cc.offload_dir, cc.offload_identity, cc.offload_disk_bytes, block_size=cc.block_size,
                            block_shape=shape, dtype=dtype)
        return cls(HostTier(cc.offload_host_blocks, shape, dtype), disk)

    def close(self) -> None:
        """Stop the disk tier's writer once what it has queued is written."""
        if self.disk is not None:
            self.disk.close()

    @property
    def block_bytes(self) -> int:
        return self.host.block_bytes

    def on_evict(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        """The device pool hands out a cached block again: keep its contents in a host slot."""
        slot = self.host.put(block_hash, tokens)
        if slot is not None:
            self.host.pin(slot)  # (a lookup later in this schedule may load it: keep it until the runner ran)
            self.stores.append((block_id, slot))

    def export(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> bool:
        """Prefill/decode disaggregation: make sure a finished request's block reaches the disk tier. Already
        on disk: nothing to do; in a host slot: written from there; else a host slot is taken for it (copied
        from the device with this schedule's stores, then written). False: no slot free (every one pinned by
        this schedule): the caller runs the stores so far and asks again."""
        disk = self.disk
        if disk is not None and disk.has_file(block_hash):
            disk.touch(block_hash)
            return True
        slot = self.host.get(block_hash, tokens)
        if slot is not None:
            if disk is not None:
                disk.write(block_hash, tokens, self.host.data[slot])
            return True
        slot = self.host.put(block_hash, tokens)
        if slot is None:
            return False
        self.host.pin(slot)
        self.stores.append((block_id, slot))
        return True

    def find(self, block_hash: int, tokens: tuple[int, ...]) -> int | None:
        """The host slot holding this block, read from disk first if only the disk has it; pinned until the
        runner has run this schedule. None: in no tier (or no free slot)."""
        slot = self.host.get(block_hash, tokens)
        if slot is None and self.disk is not None:
            kv = self.disk.read(block_hash, tokens)
            if kv is None:
                return None
            slot = self.host.put(block_hash, tokens)
            if slot is None:
                return None
            self.host.data[slot] = kv
            self._from_disk.add(slot)
        if slot is not None:
            self.host.pin(slot)
        return slot

    def load(self, slot: int, block_id: int) -> None:
        """Record that device block `block_id` gets the contents of host slot `slot` this step."""
        self.loads.append((slot, block_id))
        self.counters.loaded_blocks += 1
        if slot in self._from_disk:
            self.counters.disk_hit_blocks += 1
        else:
            self.counters.host_hit_blocks += 1

    def take(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """This schedule's (stores, loads), for its `SchedulerOutput`; slots are unpinned from here on (the
        runner executes them before the next schedule)."""
        stores, loads = self.stores, self.loads
        self.stores, self.loads = [], []
        self.host.unpin_all()
        self._from_disk.clear()
        self.counters.stored_blocks += len(stores)
        return stores, loads

    def stored(self, slots) -> None:
        """The runner has copied blocks into these host slots: pass them on to the disk tier."""
        if self.disk is None or not self.disk.enabled:
            return
        data = self.host.data
        for slot in slots:
            key = self.host.key_of(slot)
            if key is not None:
                self.disk.write(key[0], key[1], data[slot])

    def flush(self) -> None:
        """Wait for the disk tier's queued writes."""
        if self.disk is not None:
            self.disk.flush()

    def stats(self) -> dict[str, int | float]:
        """Hits, blocks and bytes per tier, for metrics and benchmarks."""
        c, b = self.counters, self.block_bytes
        out = {"host_hit_blocks": c.host_hit_blocks, "disk_hit_blocks": c.disk_hit_blocks,
               "stored_blocks": c.stored_blocks, "loaded_blocks": c.loaded_blocks,
               "host_stored_bytes": c.stored_blocks * b, "host_loaded_bytes": c.loaded_blocks * b,
               "host_blocks": len(self.host), "host_slots": self.host.num_slots}
        if self.disk is not None:
            out.update(disk_blocks=len(self.disk.index), disk_written_bytes=self.disk.num_bytes_written,
                       disk_read_bytes=self.disk.num_bytes_read, disk_enabled=int(self.disk.enabled))
        return out


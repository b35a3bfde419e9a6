"""The scheduler's side of the tiers, with exact block ids: an evicted cached block is stored to a host slot in
the step that hands it out again (before anything overwrites it), and a prompt whose blocks left the device is
given fresh blocks loaded from their host slots, then computes only the rest."""

from __future__ import annotations

import numpy as np

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.kv_offload import HostTier, KVOffload
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams

BS = 4


def make(num_blocks: int = 6, host_slots: int = 8) -> Scheduler:
    offload = KVOffload(HostTier(host_slots, (1, 2, BS, 1, 1), np.float32))
    kv = KVCacheManager(num_blocks, BS, enable_prefix_caching=True, offload=offload)
    return Scheduler(SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64), kv)


def run_to_end(s: Scheduler, req: Request) -> list:
    s.add_request(req)
    outs = []
    while s.has_unfinished_requests():
        out = s.schedule()
        outs.append(out)
        s.update_from_output(out, [7] * len(out.requests))
    return outs


def req(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=1), seed=0)


def test_eviction_stores_and_a_returning_prefix_loads():
    s = make()
    a = list(range(100, 113))  # 13 tokens: 3 full blocks and one token
    (first,) = run_to_end(s, req("a", a))
    assert first.block_ids[0] == [1, 2, 3, 4] and not first.kv_store and not first.kv_load
    # a different 13-token prompt needs 4 blocks: block 5 is free, then the freed ones go in LRU order (a's tail
    # block first: it was freed first; its hash-less last block is not stored)
    (second,) = run_to_end(s, req("b", list(range(200, 213))))
    assert second.block_ids[0] == [5, 4, 3, 2]
    assert [d for d, _ in second.kv_store] == [3, 2]  # a's blocks 2 and 1 (ids 3, 2), stored before the step
    offload = s.kv.offload
    assert offload.counters.stored_blocks == 2
    # a again: block 0 (id 1) is still cached on the device, blocks 1-2 come from host slots
    out = run_to_end(s, req("a2", a + [1, 2, 3]))[0]
    slot_of = {dev: slot for dev, slot in second.kv_store}
    table = out.block_ids[0]
    assert table[0] == 1
    assert out.kv_load == [(slot_of[2], table[1]), (slot_of[3], table[2])]  # a's blocks 1 and 2, in order
    assert out.starts[0] == 12 and out.num_new_tokens[0] == 4  # only the tail is computed
    assert s.kv.num_hit_tokens == 4 and offload.counters.host_hit_blocks == 2
    # the loaded blocks are cached on the device again
    assert s.kv.pool.blocks[table[1]].block_hash is not None


def test_stores_precede_everything_and_loads_come_last_in_one_step():
    """A block evicted and looked up in the same schedule is stored, then loaded, in that order."""
    s = make(num_blocks=5)
    a = list(range(100, 109))  # 2 full blocks + 1
    run_to_end(s, req("a", a))  # blocks 1, 2, 3
    s.add_request(req("b", list(range(300, 313))))  # needs 4 blocks: evicts a's cached two
    s.add_request(req("c", a + [5]))
    out = s.schedule()
    stored = dict(out.kv_store)
    assert set(stored) == {1, 2}
    # c could not be admitted (the pool is short), so nothing is loaded yet; next time it is
    assert not out.kv_load
    s.update_from_output(out, [7])
    out = s.schedule()
    assert sorted(slot for slot, _ in out.kv_load) == sorted(stored.values())


def test_no_tiers_without_prefix_caching():
    offload = KVOffload(HostTier(4, (1, 2, BS, 1, 1), np.float32))
    kv = KVCacheManager(6, BS, enable_prefix_caching=False, offload=offload)
    assert kv.offload is None and kv.pool.on_evict is None

"""BlockPool and KVCacheManager: exact block ids, free order, ref counts."""

import pytest

from jaxpaged.core.block_pool import BlockPool
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams


def test_null_block_is_never_handed_out():
    pool = BlockPool(4)
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 3]
    assert pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)


def test_free_order_is_lru():
    pool = BlockPool(6)
    a, b, c = pool.get_new_blocks(1), pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.free_blocks(b)
    pool.free_blocks(a)
    # untouched blocks 4, 5 come first, then in the order they were freed
    assert [x.block_id for x in pool.free_queue] == [4, 5, 2, 1]
    assert [x.block_id for x in pool.get_new_blocks(4)] == [4, 5, 2, 1]
    assert c[0].ref_cnt == 1


def test_shared_block_is_freed_by_its_last_holder():
    pool = BlockPool(3)
    (blk,) = pool.get_new_blocks(1)
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 1
    pool.free_blocks([blk])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError, match="double free"):
        pool.free_blocks([blk])


def test_free_queue_removes_from_the_middle():
    pool = BlockPool(5)
    middle = pool.blocks[2]
    pool.touch([middle])  # taking a free block back out of the queue
    assert [x.block_id for x in pool.free_queue] == [1, 3, 4]
    assert pool.num_free_blocks == 3


def test_allocate_slots_on_demand_and_free():
    kv = KVCacheManager(num_blocks=5, block_size=4)
    req = Request("r", list(range(6)), SamplingParams(), seed=0)
    assert [b.block_id for b in kv.allocate_slots(req, 6)] == [1, 2]
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) == []  # fits in block 2
    req.num_computed_tokens = 8
    assert [b.block_id for b in kv.allocate_slots(req, 1)] == [3]
    assert kv.allocate_slots(req, 9) is None  # needs 3 more, 1 free: nothing changes
    assert kv.block_ids("r") == [1, 2, 3]
    kv.free(req)
    assert kv.num_free_blocks == 4
    assert [b.block_id for b in kv.pool.free_queue] == [4, 3, 2, 1]  # tail freed first

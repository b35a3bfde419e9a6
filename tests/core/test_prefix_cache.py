"""Automatic prefix caching: exact shared block ids, collision safety, LRU eviction."""

from jaxpaged.config import SchedulerConfig
from jaxpaged.core import block_pool
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams


def make(num_blocks=16, block_size=4):
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=True))


def req(rid, tokens, **kw):
    return Request(rid, list(tokens), SamplingParams(max_tokens=4, **kw), seed=0)


def run_to_end(s):
    while s.has_unfinished_requests():
        out = s.schedule()
        s.update_from_output(out, [7] * len(out.scheduled))


def test_common_prefix_shares_exact_blocks():
    s = make()
    a = req("a", range(10, 20))  # 10 tokens: blocks [10..13], [14..17] full, [18, 19] partial
    s.add_request(a)
    s.schedule()
    assert s.kv.block_ids("a") == [1, 2, 3]
    b = req("b", list(range(10, 18)) + [99, 98, 97])  # same first two blocks
    s.add_request(b)
    out = s.schedule()
    scheduled = {x.request.request_id: x for x in out.scheduled}
    assert s.kv.block_ids("b")[:2] == [1, 2] and s.kv.block_ids("b")[2] not in (1, 2, 3)
    assert scheduled["b"].num_new_tokens == 3 and scheduled["b"].start == 8 and b.num_computed_tokens == 11
    assert s.kv.pool.blocks[1].ref_cnt == 2 and s.kv.pool.blocks[3].ref_cnt == 1
    assert (s.kv.num_queried_tokens, s.kv.num_hit_tokens) == (21, 8)


def test_never_the_last_token():
    s = make()
    s.add_request(req("a", range(10, 18)))  # exactly two full blocks
    run_to_end(s)
    again = req("b", range(10, 18))
    s.add_request(again)
    out = s.schedule()
    assert out.scheduled[0].start == 4 and out.scheduled[0].num_new_tokens == 4  # one block recomputed


def test_forced_hash_collision_does_not_share(monkeypatch):
    monkeypatch.setattr(block_pool, "hash_block_tokens", lambda parent, tokens, extra=None: 1234)
    s = make()
    s.add_request(req("a", range(10, 19)))
    s.schedule()
    b = req("b", range(50, 59))
    s.add_request(b)
    out = s.schedule()
    assert out.scheduled[-1].request is b and out.scheduled[-1].start == 0
    assert not set(s.kv.block_ids("a")) & set(s.kv.block_ids("b"))


def test_freed_blocks_stay_cached_until_needed_lru():
    s = make(num_blocks=7, block_size=4)  # 6 usable blocks
    s.add_request(req("a", range(10, 19)))  # 9 prompt tokens + 3 computed outputs: blocks 1..3, all full
    run_to_end(s)
    assert s.kv.num_free_blocks == 6 and len(s.kv.pool.cached) == 3
    # freed tail first: untouched blocks first, then a's blocks from its tail to its head
    assert [b.block_id for b in s.kv.pool.free_queue] == [4, 5, 6, 3, 2, 1]
    s.add_request(req("c", range(100, 103)))  # needs one block: takes 4, a's prefix stays cached
    s.schedule()
    hit = req("d", range(10, 19))
    s.add_request(hit)
    out = s.schedule()
    assert out.scheduled[-1].start == 8 and s.kv.block_ids("d")[:2] == [1, 2]


def test_prompt_logprobs_and_penalties_skip_hits():
    s = make()
    s.add_request(req("a", range(10, 19)))
    run_to_end(s)
    for kw in (dict(prompt_logprobs=1), dict(repetition_penalty=1.2)):
        r = req(f"x{len(kw)}{list(kw)[0]}", range(10, 19), **kw)
        s.add_request(r)
        out = s.schedule()
        assert out.scheduled[-1].request is r and out.scheduled[-1].start == 0
        s.update_from_output(out, [7] * len(out.scheduled))
        run_to_end(s)


def test_a_preempted_held_request_whose_blocks_are_all_cached_still_computes_its_last_token():
    """A held request (a beam) that filled whole blocks and waits for its owner's token has hashes for every
    token. Preempted and resumed, a cache hit must still leave its last token to compute; before the fix it
    hit everything, was never scheduled, and the deadlock breaker preempted it forever (found by the
    property test)."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=2, max_model_len=256, policy="priority")
    s = Scheduler(config, KVCacheManager(4, 1, enable_prefix_caching=True))  # 3 usable blocks of 1 token
    held = Request("h", [30, 30], SamplingParams(max_tokens=1), seed=0, hold_output=True)
    s.add_request(held)
    out = s.schedule()
    s.update_from_output(out, [7])  # computed, idle: its owner has not appended a token
    s.add_request(Request("r", [10, 10], SamplingParams(max_tokens=1), seed=0, priority=2))  # needs 2 blocks
    out = s.schedule()  # nothing fits: the idle held request yields its blocks and comes back first
    assert [(x.request.request_id, x.start, x.num_new_tokens) for x in out.scheduled][0] == ("h", 1, 1)

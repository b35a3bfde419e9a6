"""Property test: random add / step / abort / preempt schedules never break the block pool's invariants."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams


def check_invariants(s: Scheduler) -> None:
    pool = s.kv.pool
    holders = Counter(b.block_id for blocks in s.kv.req_to_blocks.values() for b in blocks)
    free_ids = [b.block_id for b in pool.free_queue]
    assert len(free_ids) == len(set(free_ids)) == pool.num_free_blocks
    for b in pool.blocks[1:]:
        in_free = b.block_id in set(free_ids)
        assert in_free != (b.ref_cnt > 0), f"{b} must be free xor referenced"
        assert b.ref_cnt == holders.get(b.block_id, 0), f"{b} ref count != number of holders"
    assert pool.num_free_blocks + len(holders) == pool.num_blocks - 1
    assert set(s.kv.req_to_blocks) <= {r.request_id for r in s.running}  # only running requests hold blocks
    for r in s.running:
        assert len(s.kv.blocks_of(r.request_id)) * s.kv.block_size >= r.num_computed_tokens


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
        st.tuples(st.just("add_shared"), st.integers(1, 40), st.integers(1, 30)),  # common prefix: cache hits
        st.tuples(st.just("step"), st.integers(0, 20), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
    ),
    min_size=1, max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(actions=actions, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 48), policy=st.sampled_from(["fcfs", "priority"]), prefix_caching=st.booleans())
def test_random_schedules_keep_invariants(actions, num_blocks, block_size, budget, policy, prefix_caching):
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=10_000, policy=policy)
    s = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching))
    capacity = (num_blocks - 1) * block_size
    ids = 0
    for kind, a, b in actions:
        if kind in ("add", "add_shared"):
            prompt_len, max_tokens = min(a, capacity - 1), b
            max_tokens = max(1, min(max_tokens, capacity - prompt_len))  # admission control as the engine does
            prompt = list(range(prompt_len)) if kind == "add_shared" else [1000 + ids] * prompt_len
            s.add_request(Request(f"r{ids}", prompt, SamplingParams(max_tokens=max_tokens), seed=0,
                                  priority=a % 3))
            ids += 1
        elif kind == "step":
            out = s.schedule()
            assert out.total_num_scheduled_tokens <= budget
            assert len(out.scheduled) <= config.max_num_seqs
            for x in out.scheduled:  # the scheduled tokens fit the request's blocks
                assert len(x.block_ids) * block_size >= x.request.num_computed_tokens + x.num_new_tokens
            s.update_from_output(out, [a + 3] * len(out.scheduled))
        elif ids:
            s.abort_requests([f"r{a % ids}"])
        check_invariants(s)
    # drain: every request must finish, and every block must come back
    for _ in range(10_000):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        assert not out.is_empty, "scheduler stalled with unfinished requests"
        s.update_from_output(out, [3] * len(out.scheduled))
        check_invariants(s)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks - 1

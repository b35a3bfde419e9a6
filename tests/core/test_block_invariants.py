"""Property test: random add / step / abort / fork / preempt schedules never break the block pool's invariants."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.output import SchedulerOutput
from jaxpaged.core.sched.scheduler import Scheduler
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
    bs = s.kv.block_size
    for r in s.running:
        assert len(s.kv.blocks_of(r.request_id)) * bs >= r.num_computed_tokens
        for i, b in enumerate(s.kv.blocks_of(r.request_id)):  # a cached block holds what its holders hold there
            if b.block_hash is not None:  # (as far as the holder knows its tokens: a fork made while its parent's
                # next token was in flight shares a block the parent filled; it copies the block before writing)
                mine = r.token_ids_slice(i * bs, (i + 1) * bs)
                assert b.block_tokens[: len(mine)] == tuple(mine), f"{b} is stale for {r}"
                assert pool.cached.get(b.block_hash) is b
    assert len(s.running) <= s.config.max_num_seqs
    host_held = [h for hs in s.kv.req_to_host_blocks.values() for h in hs]  # the host pool: free xor held, once
    assert len(host_held) == len(set(host_held)) and not set(host_held) & set(s.kv.host_free)
    assert len(host_held) + len(s.kv.host_free) == s.kv.num_host_blocks
    waiting_ids = {r.request_id for r in s.waiting}
    assert set(s.kv.req_to_host_blocks) <= waiting_ids  # only preempted, waiting requests are swapped out


def feed_held(s: Scheduler, only: int | None = None) -> None:
    """Append the next token to idle held requests (all, or one chosen by `only`); end those at max_tokens."""
    idle = [r for r in s.running if r.hold_output and r.num_computed_tokens == r.num_tokens
            and not r.num_output_placeholders]
    if only is not None:
        idle = idle[only % len(idle):][:1] if idle else []
    for r in idle:
        if r.num_output_tokens >= r.sampling_params.max_tokens:
            s.abort_requests([r.request_id])
        else:
            r.output_token_ids.append(5)


actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 30)),
        st.tuples(st.just("add_shared"), st.integers(1, 40), st.integers(1, 30)),  # common prefix: cache hits
        st.tuples(st.just("step"), st.integers(0, 20), st.just(0)),
        st.tuples(st.just("abort"), st.integers(0, 30), st.just(0)),
        st.tuples(st.just("add_n"), st.integers(1, 40), st.integers(2, 4)),  # siblings fork after the prompt
        st.tuples(st.just("fork"), st.integers(0, 30), st.integers(0, 1)),  # a running request forks (shared/copied)
        st.tuples(st.just("add_held"), st.integers(1, 40), st.integers(1, 8)),  # its owner appends each token
        st.tuples(st.just("feed"), st.integers(0, 30), st.just(0)),  # owners append to idle held requests
    ),
    min_size=1, max_size=60,
)


def check_step(s: Scheduler, out: SchedulerOutput) -> None:
    """A step fits the budget and the blocks; it writes no block another request holds, but a full prefix-cache
    block computed in this very step (same tokens for every holder); copies and swap-ins land in own blocks."""
    bs = s.kv.block_size
    assert out.total_num_scheduled_tokens <= s.config.max_num_batched_tokens
    assert len(out.scheduled) <= s.config.max_num_seqs
    for x in out.scheduled:
        blocks = s.kv.blocks_of(x.request.request_id)
        assert len(blocks) * bs >= x.start + x.num_new_tokens
        written = blocks[x.start // bs : -(-(x.start + x.num_new_tokens) // bs)]
        assert all(blk.ref_cnt == 1 or blk.block_hash is not None for blk in written), "writes a shared block"
    for c in out.block_copies:
        assert s.kv.pool.blocks[c.dst].ref_cnt == 1
    for _, dev in out.swap_in:
        assert s.kv.pool.blocks[dev].ref_cnt == 1


class Runner:
    """What the runner knows of block tables, kept only from the changes each SchedulerOutput carries; and,
    with async scheduling (lag 1), the step in flight whose tokens arrive after the next schedule."""

    def __init__(self, s: Scheduler, lag: int):
        self.s, self.lag, self.tables, self.in_flight = s, lag, {}, []

    def step(self, token: int) -> SchedulerOutput:
        out = self.s.schedule()
        for rid in out.finished_ids + out.preempted_ids:
            self.tables.pop(rid, None)
        for x in out.scheduled:
            rid = x.request.request_id
            if x.block_ids is not None:
                self.tables[rid] = list(x.block_ids)
            else:
                assert rid in self.tables, f"{rid} sent changes before its whole table"
                self.tables[rid] += x.new_block_ids
            assert self.tables[rid] == self.s.kv.block_ids(rid), "the runner's table drifted from the scheduler's"
        running = {r.request_id for r in self.s.running}
        assert set(self.tables) <= running, "the runner keeps a row of a request that ended or was preempted"
        check_step(self.s, out)
        self.in_flight.append(out)
        while len(self.in_flight) > self.lag or (self.in_flight and out.is_empty):
            done = self.in_flight.pop(0)
            self.s.update_from_output(done, [token] * len(done.scheduled))
        return out


def distinct_prompt(kind: str, ids: int, length: int) -> list[int]:
    """One token repeated (no two requests share a block), but add_shared: a prefix of one sequence."""
    if kind == "add_shared":
        return list(range(length))
    return [{"add": 1000, "add_n": 2000, "add_held": 3000}[kind] + ids] * length


def run_actions(s: Scheduler, runner, actions, capacity: int, *, check, prompt=distinct_prompt) -> None:
    """Apply the random actions (`runner.step(token)` for a step), checking after each; then drain: every request
    must finish. `prompt(kind, request number, length)` gives each added request its tokens."""
    config = s.config
    ids = 0
    for kind, a, b in actions:
        if kind == "add_n":
            prompt_len = min(a, capacity - 1)
            sp = SamplingParams(max_tokens=max(1, min(8, capacity - prompt_len)), n=b)
            reqs = [Request(f"r{ids}#{i}", prompt(kind, ids, prompt_len), sp, seed=i) for i in range(b)]
            reqs[0].pending_forks = reqs[1:]
            s.add_request(reqs[0])
            ids += 1
        elif kind == "add_held":
            prompt_len = min(a, capacity - 1)
            sp = SamplingParams(max_tokens=max(1, min(b, capacity - prompt_len)))
            s.add_request(Request(f"r{ids}", prompt(kind, ids, prompt_len), sp, seed=0, hold_output=True))
            ids += 1
        elif kind == "feed":
            feed_held(s, only=a)
        elif kind == "fork":
            if s.running and s.num_reserved_seqs < config.max_num_seqs:
                parent = s.running[a % len(s.running)]
                child = Request(f"f{ids}", parent.prompt_token_ids, parent.sampling_params, seed=1,
                                output_token_ids=list(parent.output_token_ids), hold_output=parent.hold_output)
                # a held child (a beam) waits for its owner's token; another recomputes at least the last one
                at = parent.num_computed_tokens if parent.hold_output else min(parent.num_computed_tokens,
                                                                               parent.num_tokens - 1)
                s.fork(parent, child, at, share=b % 2 == 0)
                ids += 1
        elif kind in ("add", "add_shared"):
            prompt_len = min(a, capacity - 1)
            max_tokens = max(1, min(b, capacity - prompt_len))  # admission control as the engine does
            s.add_request(Request(f"r{ids}", prompt(kind, ids, prompt_len), SamplingParams(max_tokens=max_tokens),
                                  seed=0, priority=a % 3))
            ids += 1
        elif kind == "step":
            runner.step(a + 3)
        elif ids:
            rid = f"r{a % ids}"
            s.abort_requests([rid] + [f"{rid}#{i}" for i in range(4)])
        check(s)
    for _ in range(10_000):  # drain
        feed_held(s)
        if not s.has_unfinished_requests():
            break
        had_in_flight = bool(runner.in_flight)
        out = runner.step(3)
        assert not out.is_empty or had_in_flight, "scheduler stalled with unfinished requests"
        check(s)


@settings(max_examples=150, deadline=None)
@given(actions=actions, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4, 16]),
       budget=st.integers(1, 48), policy=st.sampled_from(["fcfs", "priority", "sjf", "hybrid"]),
       prefix_caching=st.booleans(),
       host_blocks=st.sampled_from([None, 0, 3, 40]), lag=st.sampled_from([0, 1]),
       prefill_cap=st.sampled_from([0, 0, 1, 5]))
def test_random_schedules_keep_invariants(actions, num_blocks, block_size, budget, policy, prefix_caching,
                                          host_blocks, lag, prefill_cap):
    """host_blocks None: recompute preemption; else swap preemption with that many host blocks (0 and 3
    force the fall back to recompute). lag 1: async scheduling, results one step late. prefill_cap: prompt
    tokens a step may carry beside decodes."""
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=10_000, policy=policy,
                             preemption_mode="recompute" if host_blocks is None else "swap",
                             max_prefill_tokens_with_decodes=prefill_cap)
    s = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=prefix_caching,
                                         num_host_blocks=host_blocks or 0))
    capacity = (num_blocks - 1) * block_size
    runner = Runner(s, lag)
    run_actions(s, runner, actions, capacity, check=check_invariants)
    assert not s.has_unfinished_requests()
    assert s.kv.num_free_blocks == num_blocks - 1
    assert len(s.kv.host_free) == (host_blocks or 0) and not s.kv.req_to_host_blocks

"""Property test with simulated KV contents: under random schedules (async or not, swap or recompute, forks,
aborts), with a host tier behind the prefix cache, every block a step reads holds its request's own tokens,
every block stored to the host tier holds the tokens it is indexed under, and the pools' invariants hold."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.sched.output import SchedulerOutput
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.kv_offload import HostTier, KVOffload
from tests.core.test_block_invariants import actions, check_invariants, check_step, run_actions


def overlapping_prompt(kind: str, ids: int, length: int) -> list[int]:
    """Prefixes of a few sequences, so cached blocks leave the device and come back."""
    base = {"add_shared": 0, "add_n": 0, "add_held": 50}.get(kind, 500 + 100 * (ids % 2))
    return list(range(base, base + length))


def check_host_tier(t: HostTier) -> None:
    slots = [slot for slot, _ in t.entries.values()]
    assert len(slots) == len(set(slots)) and not set(slots) & set(t.free)
    assert len(slots) + len(t.free) == t.num_slots
    for h, (slot, _) in t.entries.items():
        assert t.slot_hash[slot] == h


class ContentRunner:
    """Executes each SchedulerOutput on simulated KV, in device order: a step's moves (stores first, loads last),
    then its writes; with lag 1 the writes land when the next step is scheduled, as a device would run them
    before the next step's moves. A slot holds the token id written there (None: a token never known)."""

    def __init__(self, s: Scheduler, lag: int):
        self.s, self.lag = s, lag
        self.dev: dict[int, list] = {}
        self.host: dict[int, list] = {}  # offload slots
        self.swapped: dict[int, list] = {}  # swap-preemption host blocks
        self.in_flight: list[SchedulerOutput] = []
        self.unwritten: list[list] = []  # writes of the step in flight: (request, start, n, table at schedule)
        self.reads = 0

    def block(self, b: int) -> list:
        return self.dev.setdefault(b, [None] * self.s.kv.block_size)

    def step(self, token: int) -> SchedulerOutput:
        s = self.s
        out = s.schedule()
        check_step(s, out)
        self._write_pending()
        self._move(out)
        bs = s.kv.block_size
        # a step writes every new token's K/V, then attends (so a prefix block computed in this very step may be
        # read by another request in it); a token still in flight is written once it is known (lag 1)
        self.unwritten = [(req, start, n, list(s.kv.block_ids(req.request_id)))
                          for req, start, n in zip(out.requests, out.starts, out.num_new_tokens)]
        self._write_pending(keep=self.lag > 0)
        for req, start, _ in zip(out.requests, out.starts, out.num_new_tokens):
            table = s.kv.block_ids(req.request_id)
            mine = req.token_ids_slice(0, start)
            for p in range(start):  # what the step's attention reads
                assert self.block(table[p // bs])[p % bs] == mine[p], f"{req.request_id} reads a wrong token at {p}"
            self.reads += start
        self.in_flight.append(out)
        while len(self.in_flight) > self.lag or (self.in_flight and out.is_empty):
            done = self.in_flight.pop(0)
            s.update_from_output(done, [token] * len(done.requests))
        return out

    def _write_pending(self, keep: bool = False) -> None:
        bs = self.s.kv.block_size
        for req, start, n, table in self.unwritten:
            known = req.token_ids_slice(start, start + n)
            for k in range(n):
                p = start + k
                self.block(table[p // bs])[p % bs] = known[k] if k < len(known) else None
        if not keep:
            self.unwritten = []

    def _move(self, out: SchedulerOutput) -> None:
        tier = self.s.kv.offload.host
        for dev, slot in out.kv_store:
            _, tokens = tier.key_of(slot)
            assert tuple(self.block(dev)) == tokens, f"block {dev} stored under tokens it does not hold"
            self.host[slot] = list(self.block(dev))
        for src, dst in out.fork_copies:
            self.dev[dst] = list(self.block(src))
        for dev, h in out.swap_out:
            self.swapped[h] = list(self.block(dev))
        for src, dst in out.block_copies:
            self.dev[dst] = list(self.block(src))
        for h, dev in out.swap_in:
            self.dev[dev] = list(self.swapped[h])
        for slot, dev in out.kv_load:
            assert tuple(self.host[slot]) == tier.key_of(slot)[1], f"slot {slot} holds other tokens"
            self.dev[dev] = list(self.host[slot])

    def drain(self) -> None:
        self._write_pending()


@settings(max_examples=120, deadline=None)
@given(actions=actions, num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
       budget=st.integers(1, 48), host_slots=st.sampled_from([1, 2, 6, 40]), lag=st.sampled_from([0, 1]),
       swap=st.booleans(), prefill_cap=st.sampled_from([0, 1, 5]))
def test_random_schedules_read_and_store_the_right_tokens(actions, num_blocks, block_size, budget, host_slots, lag,
                                                           swap, prefill_cap):
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=budget, max_model_len=10_000,
                             preemption_mode="swap" if swap else "recompute",
                             max_prefill_tokens_with_decodes=prefill_cap)
    offload = KVOffload(HostTier(host_slots, (1, 2, block_size, 1, 1), np.float32))
    s = Scheduler(config, KVCacheManager(num_blocks, block_size, enable_prefix_caching=True,
                                         num_host_blocks=5 if swap else 0, offload=offload))
    capacity = (num_blocks - 1) * block_size
    runner = ContentRunner(s, lag)

    def check(s: Scheduler) -> None:
        check_invariants(s)
        check_host_tier(offload.host)

    run_actions(s, runner, actions, capacity, check=check, prompt=overlapping_prompt)
    runner.drain()
    assert not s.has_unfinished_requests() and s.kv.num_free_blocks == num_blocks - 1

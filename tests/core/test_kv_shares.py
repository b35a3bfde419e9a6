"""Tenants' KV shares in the scheduler: a flooding tenant cannot keep another below its guaranteed minimum nor slow
it by more than 2x (in steps), a capped tenant never holds more than its maximum and still finishes everything, and
the victim of a full pool is the tenant furthest over its minimum. Each case also runs without shares, where it
must come out differently (so the test fails if the shares do nothing)."""

import pytest

from jaxpaged.config import SchedulerConfig
from jaxpaged.core.kv_cache_manager import KVCacheManager
from jaxpaged.core.kv_shares import KVShares
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.request import Request
from jaxpaged.sampling_params import SamplingParams

BLOCK = 4
SHARES = {"flood": (0.0, 1.0), "steady": (0.25, 0.5)}  # of 64 usable blocks: steady min 16, max 32


def make(shares, policy="fcfs", swap=False) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=64, max_model_len=512, policy=policy,
                             preemption_mode="swap" if swap else "recompute")
    s = Scheduler(config, KVCacheManager(65, BLOCK, enable_prefix_caching=False, num_host_blocks=256 if swap else 0))
    s.set_kv_shares(shares)
    return s


def req(rid, tenant, prompt, max_tokens, arrival, priority=0):
    return Request(rid, list(range(3, 3 + prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0,
                   eos_token_ids=(2,), tenant=tenant, arrival_time=arrival, priority=priority)


def usage(s: Scheduler) -> dict:
    used = {"flood": 0, "steady": 0, None: 0}
    for r in s.running:
        used[r.tenant] += len(s.kv.req_to_blocks.get(r.request_id, ()))
    return used


def run(s: Scheduler, arrivals: dict[int, list[Request]], watch=None) -> dict[str, int]:
    """Step until done (requests join at their step); the step each request finished at."""
    done, step = {}, 0
    while s.has_unfinished_requests() or any(k >= step for k in arrivals):
        for r in arrivals.get(step, []):
            s.add_request(r)
        out = s.schedule()
        for _, r, _ in s.update_from_output(out, [7] * len(out.scheduled)):
            if r.status.finished:
                done[r.request_id] = step
        if watch is not None:
            watch(s, step)
        step += 1
        assert step < 2000
    return done


def flood_then_steady(flooder="flood"):
    flood = [req(f"f{i}", flooder, 20, 40, arrival=i * 1e-3) for i in range(30)]  # 15 blocks each at the end
    steady = [req(f"s{i}", "steady", 8, 16, arrival=1.0 + i) for i in range(2)]  # 6 blocks each
    return {0: flood, 12: steady}


@pytest.mark.parametrize("flooder,swap", [("flood", False), ("flood", True), (None, False)])
def test_a_flooding_tenant_cannot_hold_another_below_its_guaranteed_share(flooder, swap):
    """flooder None: requests without a tenant (the server's --api-key) flood; swap: victims go to host memory
    and come back by swap-in, held to the same shares."""
    alone = run(make(SHARES, swap=swap), {12: flood_then_steady(flooder)[12]})
    preempted_steady, below = [], []

    def watch(s, step):
        preempted_steady.extend(r.request_id for r in s.waiting if r.tenant == "steady" and r.num_preemptions)
        # steady's two requests need 12 blocks at most, within its minimum of 16: from two steps after they
        # arrive, neither may wait
        if step >= 14 and any(r.tenant == "steady" for r in s.waiting):
            below.append(step)

    s = make(SHARES, swap=swap)
    done = run(s, flood_then_steady(flooder), watch)
    latency = max(done[f"s{i}"] for i in range(2)) - 12
    assert latency <= 2 * (max(alone.values()) - 12), (latency, alone)
    assert not preempted_steady and not below
    assert all(f"f{i}" in done for i in range(30)) and s.kv.num_free_blocks == 64
    # without shares the flood keeps steady waiting: the test above would fail
    if swap:
        assert s.num_swaps > 0
    plain = run(make(None, swap=swap), flood_then_steady(flooder))
    assert max(plain[f"s{i}"] for i in range(2)) - 12 > 2 * (max(alone.values()) - 12)


def test_a_capped_tenant_never_holds_more_than_its_maximum_and_finishes():
    shares = {"flood": (0.0, 0.25), "steady": (0.0, 1.0)}  # flood: at most 16 blocks
    most = []
    s = make(shares)
    done = run(s, {0: [req(f"f{i}", "flood", 20, 20, arrival=i * 1e-3) for i in range(8)]},
               lambda s, step: most.append(usage(s)["flood"]))
    assert max(most) <= 16 and len(done) == 8 and s.kv.num_free_blocks == 64
    most.clear()
    run(make(None), {0: [req(f"f{i}", "flood", 20, 20, arrival=i * 1e-3) for i in range(8)]},
        lambda s, step: most.append(usage(s)["flood"]))
    assert max(most) > 16


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
@pytest.mark.parametrize("shares,victim", [({"flood": (0.0, 1.0), "steady": (0.5, 1.0)}, "f0"), (None, "s0")])
def test_the_victim_of_a_full_pool_is_the_tenant_furthest_over_its_minimum(shares, victim, policy):
    """fcfs: steady's request is the newer (fcfs alone preempts it); priority: it has the lower priority (the
    policy alone preempts it) and a prompt that makes it need a block first, with flood's request unscheduled."""
    s = make(shares, policy)
    s.add_request(req("f0", "flood", 40, 200, arrival=1.0))
    s.add_request(req("s0", "steady", 40 if policy == "fcfs" else 42, 200, arrival=2.0, priority=1))
    victims = []
    while not victims:
        out = s.schedule()
        victims += out.preempted_ids
        s.update_from_output(out, [7] * len(out.scheduled))
    assert victims == [victim]


def test_requests_that_cannot_fit_in_their_tenants_maximum_are_refused():
    shares = KVShares({"t": (0.0, 0.25)}, num_blocks=65, block_size=4)
    shares.check_fits("t", 64)
    with pytest.raises(ValueError, match="tenant 't''s kv_share.max allows \\(16 x 4 tokens\\)"):
        shares.check_fits("t", 65)
    with pytest.raises(ValueError, match="not a known tenant"):
        shares.check_fits("nobody", 4)
    shares.check_fits(None, 10_000)  # (no tenant: the pool's own limit applies)

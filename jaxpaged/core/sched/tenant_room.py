"""Tenants' guaranteed KV shares: the preemptions that make room for a tenant below its minimum
(`core/kv_shares.py` holds the shares and their arithmetic; the scheduler calls this first in each step)."""

from __future__ import annotations

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.core.sched.output import SchedulerOutput


def make_room_for_guarantees(sched, out: SchedulerOutput) -> None:
    """While tenants below their minimum share wait for blocks the pool does not have free, preempt requests of
    tenants above their own minimum (the furthest over first; its newest, or its last in the policy's order)."""
    shares, kv = sched.shares, sched.kv
    used = shares.usage(sched.running, kv.req_to_blocks)
    need, owed = 0, set()
    for r in sched.waiting:
        t = r.tenant
        if shares.applies(t) and t not in owed and used[t] < shares.min[t]:
            owed.add(t)
            need += min(shares.min[t] - used[t], cdiv(r.num_tokens, kv.block_size))
    while need and kv.num_free_blocks < need:
        over = shares.furthest_over([r for r in sched.running if r.tenant not in owed], used)
        if not over:
            return
        victim = sched._last_in_policy(over)
        if shares.applies(victim.tenant):
            used[victim.tenant] -= len(kv.req_to_blocks.get(victim.request_id, ()))
        sched._preempt(victim, out)
        out.preempted_ids.append(victim.request_id)

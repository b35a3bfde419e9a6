"""Tenants' shares of the KV pool (server/tenants.py): a guaranteed minimum and a hard maximum, in blocks.

A tenant's usage is the blocks its running requests hold (a block shared by several requests counts for each).
The scheduler enforces the shares:
- a tenant never holds more than its maximum: a request that would pass it waits (admission) or, running,
  makes room by preempting the tenant's own newest request;
- a tenant below its minimum that has requests waiting gets blocks first: no other tenant is admitted into the
  room it is owed, and when the pool is full, requests of tenants above their own minimum are preempted for it
  (the tenant furthest over first; the same rule picks the victim whenever the pool runs out).
Requests without a tenant (offline use), or of a tenant the shares do not name (a snapshot restored under
other tenants), have neither a minimum nor a maximum.
"""

from __future__ import annotations

from collections.abc import Iterable

from jaxpaged.core.kv_cache_manager import cdiv
from jaxpaged.request import Request


class KVShares:
    """Each tenant's minimum and maximum blocks, and the arithmetic the scheduler needs from them."""

    def __init__(self, shares: dict[str, tuple[float, float]], num_blocks: int, block_size: int):
        usable = num_blocks - 1  # (block 0 is the null block)
        self.min = {t: int(lo * usable) for t, (lo, _) in shares.items()}
        self.max = {t: max(1, int(hi * usable)) for t, (_, hi) in shares.items()}
        self.block_size = block_size

    def check_fits(self, tenant: str | None, num_tokens: int) -> None:
        """A request of `num_tokens` at most must fit in its tenant's maximum, or it could never run."""
        if tenant is None:
            return
        if tenant not in self.max:
            raise ValueError(f"tenant: {tenant!r} is not a known tenant")
        if cdiv(num_tokens, self.block_size) > self.max[tenant]:
            raise ValueError(f"prompt: {num_tokens} tokens (prompt + max_tokens) need more KV blocks than tenant "
                             f"{tenant!r}'s kv_share.max allows ({self.max[tenant]} x {self.block_size} tokens)")

    def usage(self, running: Iterable[Request], req_to_blocks: dict) -> dict[str | None, int]:
        """Blocks held per tenant by the running requests."""
        used: dict[str | None, int] = dict.fromkeys(self.min, 0)
        for r in running:
            if r.tenant in used:
                used[r.tenant] += len(req_to_blocks.get(r.request_id, ()))
        return used

    def applies(self, tenant: str | None) -> bool:
        return tenant in self.min

    def excess(self, tenant: str | None, used: dict) -> int:
        """Blocks a tenant holds above its minimum (requests without a share: any they hold, i.e. > 0)."""
        return used[tenant] - self.min[tenant] if tenant in self.min else 1

    def furthest_over(self, candidates: list[Request], used: dict) -> list[Request]:
        """The candidates of the tenant(s) furthest over their minimum, or [] when none is over it."""
        excess = {r.tenant: self.excess(r.tenant, used) for r in candidates}
        most = max(excess.values(), default=0)
        return [r for r in candidates if excess[r.tenant] == most] if most > 0 else []

    def owed(self, tenants: Iterable[str | None], used: dict, but: str | None = None) -> int:
        """Blocks the given tenants (except `but`) are still owed up to their minimum."""
        return sum(max(0, self.min[t] - used[t]) for t in set(tenants) if t in self.min and t != but)

    def over_max(self, tenant: str | None, used: dict, new_blocks: int) -> bool:
        return tenant in self.max and used[tenant] + new_blocks > self.max[tenant]

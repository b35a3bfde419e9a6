"""Tenants of a shared server (`jaxpaged serve --tenants FILE`): who may call it, and each one's limits.

A tenants file (TOML, or JSON with the same structure) names each tenant and its API key:

    [tenants.alice]
    api_key = "sk-alice"
    priority = 0                     # its priority class (lower runs first; requests may ask for lower, not higher)
    max_concurrent_requests = 16     # more at once: 429
    tokens_per_minute = 200000       # prompt + max_tokens of accepted requests, a token bucket: 429 + Retry-After
    kv_share = { min = 0.25, max = 0.75 }   # of the KV pool: guaranteed, and never more

Every field but api_key is optional (no limit; kv_share min 0, max 1).
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
import tomllib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tenant:
    """One tenant's key and limits (validated by `load_tenants`)."""

    name: str
    api_key: str
    priority: int = 0
    max_concurrent_requests: int | None = None
    tokens_per_minute: int | None = None
    kv_min: float = 0.0  # fraction of the KV pool's blocks guaranteed to it
    kv_max: float = 1.0  # fraction it may never exceed


_FIELDS = {"api_key", "priority", "max_concurrent_requests", "tokens_per_minute", "kv_share"}


def _int(where: str, v, minimum: int) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{where} must be an integer >= {minimum}, got {v!r}")
    return v


def _tenant(name: str, d) -> Tenant:
    where = f"tenants.{name}"
    if not isinstance(d, dict):
        raise ValueError(f"{where} must be a table of settings, got {type(d).__name__}")
    unknown = sorted(set(d) - _FIELDS)
    if unknown:
        raise ValueError(f"{where}: unknown fields {unknown} (known: {sorted(_FIELDS)})")
    key = d.get("api_key")
    if not isinstance(key, str) or not key:
        raise ValueError(f"{where}.api_key must be a non-empty string")
    share = d.get("kv_share", {})
    if not isinstance(share, dict) or set(share) - {"min", "max"}:
        raise ValueError(f"{where}.kv_share must be a table with min and/or max, got {share!r}")
    lo, hi = share.get("min", 0.0), share.get("max", 1.0)
    for k, v in (("min", lo), ("max", hi)):
        if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v <= 1:
            raise ValueError(f"{where}.kv_share.{k} must be a fraction of the pool in [0, 1], got {v!r}")
    if lo > hi or hi == 0:
        raise ValueError(f"{where}.kv_share: need 0 <= min <= max and max > 0, got min {lo}, max {hi}")
    opt = {k: _int(f"{where}.{k}", d[k], 1) for k in ("max_concurrent_requests", "tokens_per_minute") if k in d}
    return Tenant(name, key, priority=_int(f"{where}.priority", d.get("priority", 0), 0), kv_min=float(lo),
                  kv_max=float(hi), **opt)


def parse_tenants(data) -> list[Tenant]:
    """Tenants from a parsed file ({"tenants": {name: settings}}); ValueError naming the field at fault."""
    if not isinstance(data, dict) or set(data) != {"tenants"} or not isinstance(data["tenants"], dict):
        raise ValueError("a tenants file holds one table, `tenants`, of tenants by name")
    tenants = [_tenant(name, d) for name, d in data["tenants"].items()]
    if not tenants:
        raise ValueError("tenants: the file names no tenant")
    keys = [t.api_key for t in tenants]
    if len(set(keys)) != len(keys):
        raise ValueError("tenants: two tenants have the same api_key")
    if sum(t.kv_min for t in tenants) > 1 + 1e-9:
        raise ValueError(f"tenants: the guaranteed KV shares (kv_share.min) add up to "
                         f"{sum(t.kv_min for t in tenants):.3g}, more than the whole pool")
    return tenants


def load_tenants(path: str) -> list[Tenant]:
    """Read a tenants file: TOML (.toml) or JSON."""
    if not os.path.isfile(path):
        raise ValueError(f"--tenants: no such file {path!r}")
    try:
        with open(path, "rb") as f:
            data = tomllib.load(f) if path.endswith(".toml") else json.load(f)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--tenants: {path} is not valid {'TOML' if path.endswith('.toml') else 'JSON'}: {e}"
                         ) from None
    return parse_tenants(data)


@dataclass
class TokenBucket:
    """tokens_per_minute as a bucket that refills continuously and holds at most a minute's tokens."""

    per_minute: int
    level: float = field(init=False)
    stamp: float = field(default_factory=time.monotonic)

    def __post_init__(self) -> None:
        self.level = float(self.per_minute)

    def take(self, tokens: int, now: float | None = None) -> float:
        """Take `tokens` if there are enough and return 0; else take none and return the seconds until there are
        (inf when more than a minute's worth is asked for)."""
        now = time.monotonic() if now is None else now
        self.level = min(self.per_minute, self.level + (now - self.stamp) * self.per_minute / 60)
        self.stamp = now
        if tokens <= self.level:
            self.level -= tokens
            return 0.0
        if tokens > self.per_minute:
            return math.inf
        return (tokens - self.level) * 60 / self.per_minute

    def give(self, tokens: int) -> None:
        """Put back tokens taken for a request that was then refused."""
        self.level = min(self.per_minute, self.level + tokens)


class RateLimited(Exception):
    """A tenant's limit (`limit`: the field's name) refuses a request: `retry_after` seconds (inf: never, as
    asked)."""

    def __init__(self, message: str, limit: str, retry_after: float):
        super().__init__(message)
        self.limit, self.retry_after = limit, retry_after


class TenantLimits:
    """The concurrency and token-rate limits of every tenant, shared by the server's handlers (thread-safe)."""

    def __init__(self, tenants: list[Tenant]):
        self.by_key = {t.api_key: t for t in tenants}
        self.tenants = {t.name: t for t in tenants}
        self._running = dict.fromkeys(self.tenants, 0)
        self._buckets = {t.name: TokenBucket(t.tokens_per_minute) for t in tenants if t.tokens_per_minute}
        self._lock = threading.Lock()

    def acquire(self, tenant: Tenant, tokens: int) -> None:
        """Count a request in (its prompt + max_tokens `tokens`), or raise RateLimited."""
        with self._lock:
            limit = tenant.max_concurrent_requests
            if limit is not None and self._running[tenant.name] >= limit:
                raise RateLimited(f"tenant {tenant.name!r} has {limit} requests running, its max_concurrent_requests",
                                  "max_concurrent_requests", retry_after=1.0)
            bucket = self._buckets.get(tenant.name)
            wait = bucket.take(tokens) if bucket is not None else 0.0
            if wait == math.inf:
                raise RateLimited(f"this request needs {tokens} tokens (prompt + max_tokens), more than tenant "
                                  f"{tenant.name!r}'s tokens_per_minute ({tenant.tokens_per_minute})",
                                  "tokens_per_minute", math.inf)
            if wait:
                raise RateLimited(f"tenant {tenant.name!r} is over its tokens_per_minute "
                                  f"({tenant.tokens_per_minute}); this request needs {tokens} tokens",
                                  "tokens_per_minute", wait)
            self._running[tenant.name] += 1

    def refund(self, tenant: Tenant, tokens: int) -> None:
        """Give back the tokens of a request refused after `acquire` (it still holds its slot until `release`)."""
        with self._lock:
            if (bucket := self._buckets.get(tenant.name)) is not None:
                bucket.give(tokens)

    def release(self, tenant: Tenant) -> None:
        with self._lock:
            self._running[tenant.name] -= 1

    def running(self, name: str) -> int:
        return self._running[name]

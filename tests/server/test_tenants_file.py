"""Tenants files (TOML or JSON): every field read, each mistake named; `serve --tenants` refuses a bad file before the
model loads (tests/test_cli.py); the token bucket refills at its rate and holds at most a minute."""

import json
import math

import pytest

from server.tenants import RateLimited, Tenant, TenantLimits, TokenBucket, load_tenants, parse_tenants

TOML = """
[tenants.alice]
api_key = "sk-alice"
priority = 1
max_concurrent_requests = 4
tokens_per_minute = 6000
kv_share = { min = 0.25, max = 0.5 }

[tenants.bob]
api_key = "sk-bob"
"""


def test_toml_and_json_files_give_the_same_tenants(tmp_path):
    (tmp_path / "t.toml").write_text(TOML)
    data = {"tenants": {"alice": {"api_key": "sk-alice", "priority": 1, "max_concurrent_requests": 4,
                                  "tokens_per_minute": 6000, "kv_share": {"min": 0.25, "max": 0.5}},
                        "bob": {"api_key": "sk-bob"}}}
    (tmp_path / "t.json").write_text(json.dumps(data))
    want = [Tenant("alice", "sk-alice", 1, 4, 6000, 0.25, 0.5), Tenant("bob", "sk-bob")]
    assert load_tenants(str(tmp_path / "t.toml")) == want == load_tenants(str(tmp_path / "t.json"))


@pytest.mark.parametrize("tenants,message", [
    ({"a": {"api_key": "k", "max_concurent_requests": 2}}, "tenants.a: unknown fields ['max_concurent_requests']"),
    ({"a": {}}, "tenants.a.api_key must be a non-empty string"),
    ({"a": {"api_key": "k", "kv_share": {"min": 0.5, "max": 0.25}}}, "tenants.a.kv_share: need 0 <= min <= max"),
    ({"a": {"api_key": "k", "kv_share": {"max": 1.5}}}, "tenants.a.kv_share.max must be a fraction"),
    ({"a": {"api_key": "k", "kv_share": {"minimum": 0.5}}}, "tenants.a.kv_share must be a table with min"),
    ({"a": {"api_key": "k", "tokens_per_minute": 0}}, "tenants.a.tokens_per_minute must be an integer >= 1"),
    ({"a": {"api_key": "k", "priority": -1}}, "tenants.a.priority must be an integer >= 0"),
    ({"a": {"api_key": "k"}, "b": {"api_key": "k"}}, "two tenants have the same api_key"),
    ({"a": {"api_key": "k", "kv_share": {"min": 0.6}}, "b": {"api_key": "j", "kv_share": {"min": 0.6}}},
     "guaranteed KV shares (kv_share.min) add up to 1.2"),
    ({}, "names no tenant"),
])
def test_mistakes_are_named(tenants, message):
    with pytest.raises(ValueError) as e:
        parse_tenants({"tenants": tenants})
    assert message in str(e.value)


def test_token_bucket_refills_at_its_rate_and_holds_a_minute():
    b = TokenBucket(600, stamp=0.0)  # 10 tokens a second
    assert b.take(500, now=0.0) == 0 and b.take(200, now=0.0) == pytest.approx(10.0)  # 100 left, 100 short
    assert b.take(200, now=10.0) == 0  # refilled
    assert b.take(601, now=1000.0) == math.inf and b.take(600, now=1000.0) == 0  # (capped at a minute's tokens)


def test_limits_count_running_requests_and_refund_refused_ones():
    t = Tenant("a", "k", max_concurrent_requests=2, tokens_per_minute=100)
    limits = TenantLimits([t])
    limits.acquire(t, 60)
    limits.refund(t, 60)  # (e.g. the prompt was then refused: its tokens come back)
    limits.release(t)
    limits.acquire(t, 90)
    with pytest.raises(RateLimited) as e:
        limits.acquire(t, 20)
    assert e.value.retry_after == pytest.approx(6.0, abs=0.1)  # 10 left, 10 short at 100/min
    limits.acquire(t, 5)
    assert limits.running("a") == 2
    with pytest.raises(RateLimited, match="max_concurrent_requests"):
        limits.acquire(t, 1)
    limits.release(t)
    limits.release(t)
    assert limits.running("a") == 0

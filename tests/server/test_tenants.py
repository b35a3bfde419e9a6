"""Tenants over HTTP: unknown keys 401; max_concurrent_requests and tokens_per_minute answer 429 with Retry-After and
OpenAI's rate_limit_exceeded body; a request beyond the tenant's KV maximum is a 400; the tenant's priority class
bounds its requests' priority; metrics carry a tenant label."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from server.tenants import parse_tenants
from tests.server.conftest import API_KEY, serving

TENANTS = parse_tenants({"tenants": {
    "alice": {"api_key": "sk-alice", "max_concurrent_requests": 1, "priority": 1},
    "bob": {"api_key": "sk-bob", "tokens_per_minute": 200},
    "carol": {"api_key": "sk-carol", "kv_share": {"min": 0.05, "max": 0.05}},  # 12 of the 255 blocks
}})


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir("llama"), tenants=TENANTS) as server:
        yield server


async def call(server, key: str, body: dict, *, stream: bool = False):
    """(status, headers, JSON body) of a completion; streamed, the first event only is read before returning."""
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {key}"}) as s:
        async with s.post(f"{server.base_url}/v1/completions", json={"prompt": [5, 6, 7], **body}) as r:
            return r.status, r.headers, await r.json()


def test_unknown_keys_get_401_and_every_tenant_and_the_admin_key_work(server):
    async def main():
        status, _, body = await call(server, "sk-nobody", {"max_tokens": 2})
        assert status == 401 and body["error"]["code"] == "invalid_api_key"
        for key in ("sk-alice", "sk-bob", "sk-carol", API_KEY):
            status, _, body = await call(server, key, {"max_tokens": 2})
            assert status == 200 and body["usage"]["completion_tokens"] >= 1, (key, body)
    asyncio.run(main())


def test_max_concurrent_requests_answers_429_with_retry_after(server):
    async def main():
        async with aiohttp.ClientSession(headers={"Authorization": "Bearer sk-alice"}) as s:
            async with s.post(f"{server.base_url}/v1/completions",
                              json={"prompt": [5, 6], "max_tokens": 200, "ignore_eos": True, "stream": True}) as r:
                await r.content.readline()  # the first event: the request runs
                held = [q for q in server.engine.engine.scheduler.requests.values() if not q.finished]
                assert [q.priority for q in held] == [1]  # (asked for 0: its tenant's class is 1)
                status, headers, body = await call(server, "sk-alice", {"max_tokens": 2})
                assert status == 429 and headers["Retry-After"] == "1"
                assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["type"] == "requests"
                assert "max_concurrent_requests" in body["error"]["message"]
                status, _, _ = await call(server, "sk-bob", {"max_tokens": 2})  # other tenants are not held up
                assert status == 200
                await r.read()
        status, _, _ = await call(server, "sk-alice", {"max_tokens": 2})
        assert status == 200
    asyncio.run(main())


def test_tokens_per_minute_answers_429_with_the_seconds_until_enough_tokens(server):
    async def main():
        status, _, _ = await call(server, "sk-bob", {"max_tokens": 150})  # 3 + 150 of 200 a minute
        assert status == 200
        status, headers, body = await call(server, "sk-bob", {"max_tokens": 150})
        assert status == 429 and body["error"]["code"] == "rate_limit_exceeded"
        # 106-126 tokens short (earlier tests took 0-20) at 3.3 tokens/s
        assert 30 <= int(headers["Retry-After"]) <= 39, headers["Retry-After"]
        status, headers, body = await call(server, "sk-bob", {"max_tokens": 240})  # more than a minute's tokens
        assert status == 429 and "Retry-After" not in headers and "more than tenant 'bob'" in body["error"]["message"]
    asyncio.run(main())


def test_a_request_beyond_the_tenants_kv_maximum_is_refused(server):
    block = server.engine.engine.config.cache_config.block_size

    async def main():
        status, _, body = await call(server, "sk-carol", {"max_tokens": 12 * block - 3, "ignore_eos": True})
        assert status == 200 and body["usage"]["completion_tokens"] == 12 * block - 3
        status, _, body = await call(server, "sk-carol", {"max_tokens": 12 * block - 2})
        assert status == 400 and "tenant 'carol''s kv_share.max allows (12 x" in body["error"]["message"], body
    asyncio.run(main())


def test_metrics_carry_the_tenant(server):
    async def main():
        await call(server, "sk-alice", {"max_tokens": 3, "ignore_eos": True})
        async with aiohttp.ClientSession() as s:
            async with s.get(f"{server.base_url}/metrics") as r:
                text = await r.text()
        assert 'jaxpaged:tenant_requests_total{tenant="alice"}' in text
        assert 'jaxpaged:tenant_request_success_total{finished_reason="length",tenant="alice"}' in text
        assert 'jaxpaged:tenant_rejections_total{limit="max_concurrent_requests",tenant="alice"}' in text
        assert 'jaxpaged:tenant_kv_blocks{tenant="carol"}' in text
    asyncio.run(main())

"""A bounded fuzz of every POST endpoint from the OpenAPI document (tests/server/fuzz.py): 2,000 generated
requests, valid and hostile, and the server answers each within the contract, logs no traceback, stays healthy
and holds no KV block afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time

import aiohttp
import pytest

from server.state import BODY_TIMEOUT_S, STATE
from tests.server.conftest import API_KEY, serving
from tests.server.fuzz import check_answer, fuzz

NUM_REQUESTS = 2000


@pytest.fixture(scope="module")
def short_server(tiny_model_dir):
    """A server whose context is short, so a generated request costs at most a few dozen steps."""
    with serving(tiny_model_dir("llama"), max_model_len=64, num_kv_blocks=128) as server:
        yield server


def test_generated_requests_keep_the_contract(short_server, caplog):
    caplog.set_level(logging.WARNING)
    tally = fuzz(short_server.base_url, NUM_REQUESTS, headers={"Authorization": f"Bearer {API_KEY}"})
    assert tally.sent >= NUM_REQUESTS
    assert tally.breaches == []
    statuses = {s for _, s in tally.status}
    assert 200 in statuses and 400 in statuses  # (it reached the engine and the validators both)
    served = sum(n for (p, s), n in tally.status.items() if s == 200 and p.startswith("/v1"))
    assert served >= NUM_REQUESTS // 20, tally.summary()
    tracebacks = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert tracebacks == [], tracebacks[0].getMessage()

    engine, kv = short_server.engine.engine, short_server.engine.engine.kv_cache_manager
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (engine.has_unfinished_requests() or kv.usage() > 0):
        time.sleep(0.05)
    assert kv.usage() == 0 and short_server.engine.num_unfinished == 0

    async def health():
        async with aiohttp.ClientSession() as s, s.get(short_server.base_url + "/health") as r:
            return r.status
    assert asyncio.run(health()) == 200


def test_the_answer_check_sees_a_breach():
    """(The check the fuzz relies on can fail: a 500, a 400 without OpenAI's error body, a 200 of the wrong
    shape, a stream cut before [DONE].)"""
    assert check_answer("/v1/completions", 500, "application/json", b"{}")
    assert check_answer("/v1/completions", 400, "application/json", b'{"detail": "bad"}')
    assert check_answer("/detokenize", 200, "application/json", b'{"text": "x"}')
    assert check_answer("/v1/chat/completions", 200, "text/event-stream", b'data: {"id": "x"}\n\n')
    assert check_answer("/detokenize", 200, "application/json", b'{"prompt": "x"}') is None


def raw_post(server, path: str, data: bytes, content_type: str = "application/json") -> tuple[int, dict]:
    async def go():
        async with (aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s,
                    s.post(server.base_url + path, data=data, headers={"Content-Type": content_type}) as r):
            return r.status, await r.json()
    return asyncio.run(go())


def serves(server) -> bool:
    status, body = raw_post(server, "/v1/completions", json.dumps({"prompt": "w5", "max_tokens": 2}).encode())
    return status == 200 and body["choices"][0]["finish_reason"] == "length"


HOSTILE = [
    ("a 1 MB prompt", "/v1/completions", {"prompt": "w5 " * 350_000, "max_tokens": 1}, 400, "prompt"),
    ("a 1 MB message", "/v1/chat/completions", {"messages": [{"role": "user", "content": "w5 " * 350_000}]},
     400, "messages"),
    ("n past the sequence slots", "/v1/completions", {"prompt": "w5", "n": 10**6}, 400, "n"),
    ("max_tokens past the context", "/v1/completions", {"prompt": "w5", "max_tokens": 65}, 400, "max_tokens"),
    ("a penalty float32 cannot hold", "/v1/completions", {"prompt": "w5", "repetition_penalty": 1e300}, 400,
     "repetition_penalty"),
    ("a temperature float32 cannot hold", "/v1/completions", {"prompt": "w5", "temperature": 1e300}, 400,
     "temperature"),
    ("a token id past the vocabulary", "/detokenize", {"tokens": [2**40]}, 400, "tokens"),
    ("min_tokens past int32 (the engine loop died of it once)", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "w5"}], "min_tokens": 10**18}, 200, None),
    ("a role that is an object", "/v1/chat/completions", {"messages": [{"role": {}, "content": "w5"}]}, 400,
     "messages"),
    ("an unknown field (ignored, as vLLM)", "/v1/completions", {"prompt": "w5", "max_tokens": 1, "zzz": [1]},
     200, None),
]


@pytest.mark.parametrize("path,body,status,param", [h[1:] for h in HOSTILE], ids=[h[0] for h in HOSTILE])
def test_hostile_bodies_get_a_clear_answer(short_server, path, body, status, param):
    got, answer = raw_post(short_server, path, json.dumps(body).encode())
    assert got == status, answer
    if status != 200:
        assert answer["error"]["param"] == param, answer
    assert serves(short_server)


@pytest.mark.parametrize("data,content_type", [
    (b"[" * 200_000, "application/json"),  # nested past Python's recursion limit
    (b'{"prompt": 1' + b"0" * 5000 + b"}", "application/json"),  # an integer of more digits than Python converts
    (b'{"prompt": "\\ud800 w5"}', "application/json"),  # a lone surrogate
    (b"prompt=w5", "application/x-www-form-urlencoded"),
    (b"--b\r\nContent-Disposition: form-data; name=prompt\r\n\r\nw5\r\n--b--", "multipart/form-data; boundary=b"),
], ids=["deep", "long-integer", "lone-surrogate", "form", "multipart"])
def test_bodies_that_are_not_a_json_request_are_400s(short_server, data, content_type):
    got, answer = raw_post(short_server, "/v1/completions", data, content_type)
    assert got == 400 and answer["error"]["message"], answer
    assert serves(short_server)


def test_a_slow_body_times_out_and_others_are_served_meanwhile(short_server):
    """Slow-loris: a client that sends its headers and then a byte now and then holds no handler past the body
    timeout (a 408), and the server answers others while it trickles."""
    state = short_server.runner.app[STATE]
    state.body_timeout_s = 1.0

    async def slow():
        reader, writer = await asyncio.open_connection("127.0.0.1", short_server.port)
        writer.write(("POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Authorization: Bearer {API_KEY}\r\nContent-Length: 1000\r\n\r\n").encode())
        answer = asyncio.ensure_future(reader.read(200))
        for _ in range(30):  # (3 s of trickling, past the 1 s timeout)
            if answer.done():
                break
            with contextlib.suppress(ConnectionError):
                writer.write(b" ")
                await writer.drain()
            await asyncio.sleep(0.1)
        head = await asyncio.wait_for(answer, 5)
        writer.close()
        return head

    async def others():
        await asyncio.sleep(0.2)
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            for _ in range(3):
                async with s.post(short_server.base_url + "/v1/completions",
                                  json={"prompt": "w5", "max_tokens": 2}) as r:
                    assert r.status == 200

    async def both():
        return await asyncio.gather(slow(), others())
    try:
        head, _ = asyncio.run(both())
    finally:
        state.body_timeout_s = BODY_TIMEOUT_S
    assert head.startswith(b"HTTP/1.1 408"), head


def test_a_thousand_concurrent_connections(short_server):
    """1,000 clients at once, each its own connection: every one answered, none lost, no block held after."""
    async def go():
        connector = aiohttp.TCPConnector(limit=0, force_close=True)
        async with aiohttp.ClientSession(connector=connector,
                                         headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            async def one(i):
                body = {"prompt": f"w{i % 50}", "max_tokens": 2, "stream": i % 2 == 0}
                async with s.post(short_server.base_url + "/v1/completions", json=body,
                                  timeout=aiohttp.ClientTimeout(total=300)) as r:
                    await r.read()
                    return r.status
            return await asyncio.gather(*(one(i) for i in range(1000)))
    statuses = asyncio.run(go())
    assert statuses == [200] * 1000
    kv = short_server.engine.engine.kv_cache_manager
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and kv.usage() > 0:
        time.sleep(0.05)
    assert kv.usage() == 0

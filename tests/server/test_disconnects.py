"""A client that goes away aborts its request at once: nothing left running, every KV block free, counted as abort."""

from __future__ import annotations

import asyncio
import gc
import time

import aiohttp
import pytest

from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from tests.server.conftest import API_KEY, LiveServer

MAX_TOKENS = 8000  # many seconds of decoding for 8 requests: far more than the test waits; only an abort ends them
NUM_CLIENTS = 8


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model_dir("llama-long"), num_kv_blocks=8 * 510,
                                                  max_model_len=8192, max_num_batched_tokens=128, compile_guard=True))
    live = LiveServer(engine, API_KEY)
    yield live
    live.stop()


def abort_count(server) -> float:
    metric = server.engine.engine.metrics.success.labels(finished_reason="abort")
    return metric._value.get()


def finished_count(server) -> float:
    return sum(server.engine.engine.metrics.success.labels(finished_reason=r)._value.get() for r in ("length", "stop"))


def body(endpoint: str, i: int, stream: bool) -> tuple[str, dict]:
    common = {"model": "tiny", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": stream, "temperature": 0}
    if endpoint == "chat":
        return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": f"w{i + 3} w9"}]}
    return "/v1/completions", {**common, "prompt": f"w{i + 3} w9"}


async def hang_up(server, endpoint: str, i: int, stream: bool) -> None:
    path, payload = body(endpoint, i, stream)
    async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
        if stream:
            async with s.post(server.base_url + path, json=payload) as r:
                seen = 0
                async for _ in r.content:
                    seen += 1
                    if seen == 6:  # a few events, then close the connection
                        break
        else:
            with pytest.raises(asyncio.TimeoutError):
                async with s.post(server.base_url + path, json=payload,
                                  timeout=aiohttp.ClientTimeout(total=0.5)) as r:
                    await r.read()


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
@pytest.mark.parametrize("stream", [True, False])
def test_client_gone_aborts_at_once(server, endpoint, stream):
    engine, kv = server.engine.engine, server.engine.engine.kv_cache_manager
    aborted, finished = abort_count(server), finished_count(server)

    async def go():
        await asyncio.gather(*(hang_up(server, endpoint, i, stream) for i in range(NUM_CLIENTS)))
    gc.disable()  # an idle server collects no garbage: the abort must not wait for a collection to find it
    try:
        asyncio.run(go())
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline and (engine.has_unfinished_requests() or kv.usage() > 0):
            time.sleep(0.02)
    finally:
        gc.enable()
    assert not engine.has_unfinished_requests() and server.engine.num_unfinished == 0
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert abort_count(server) - aborted == NUM_CLIENTS
    assert finished_count(server) == finished, "a request ran to its end: the test did not test aborts"

"""Injected faults (jaxpaged/faults.py): a failure that concerns one request ends that request with an error and
the others go on; a failure of the engine itself ends every request with an error, /health says 503 and
`serve()` returns exit status 1; the disk tier survives a failed write with no partial file left behind."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
import time

import aiohttp
import numpy as np
import pytest

import jaxpaged.faults as faults
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from server.serve import bind_socket, serve
from tests.kv_offload.test_disk_tier import block, tier
from tests.server.conftest import API_KEY, serving

CHOICE = {"guided_choice": ["alpha", "beta"]}


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir("llama-bytes")) as s:  # (a tokenizer llguidance reads)
        yield s


@pytest.fixture(autouse=True)
def nothing_armed_after():
    yield
    faults.disarm()


async def _post(session, url: str, body: dict):
    async with session.post(url, json=body) as r:
        raw = (await r.read()).decode()
        if r.content_type == "text/event-stream":
            return r.status, [json.loads(e[6:]) for e in raw.split("\n\n") if e and e != "data: [DONE]"]
        return r.status, json.loads(raw)


def post_all(base_url: str, bodies: list[dict]) -> list:
    async def go():
        async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
            return await asyncio.gather(*(_post(s, base_url + "/v1/completions", b) for b in bodies))
    return asyncio.run(go())


def plain(i: int) -> dict:
    return {"prompt": f"w{i} w{i + 1}", "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def settled(server) -> bool:
    engine, kv = server.engine.engine, server.engine.engine.kv_cache_manager
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (engine.has_unfinished_requests() or kv.usage() > 0):
        time.sleep(0.02)
    return kv.usage() == 0 and server.engine.num_unfinished == 0 and server.engine.errored is None


@pytest.mark.parametrize("stream", [False, True])
def test_a_failing_grammar_matcher_ends_only_its_request(server, stream):
    expected = [out["choices"][0]["text"] for _, out in post_all(server.base_url, [plain(i) for i in range(3)])]
    faults.arm("grammar")
    constrained = {"prompt": "w1", "max_tokens": 8, "stream": stream, **CHOICE}
    (status, failed), *others = post_all(server.base_url, [constrained] + [plain(i) for i in range(3)])
    if stream:
        assert status == 200 and failed[-1]["choices"][0]["finish_reason"] == "error"
    else:
        assert status == 500 and failed["error"]["type"] == "InternalServerError", failed
    assert [out["choices"][0]["text"] for _, out in others] == expected  # (the step's others, unchanged)
    assert settled(server)
    (status, out), = post_all(server.base_url, [{**constrained, "stream": False}])
    assert status == 200 and out["choices"][0]["text"] in CHOICE["guided_choice"]


def test_a_failing_tokenizer_is_a_500_for_that_request(server):
    faults.arm("tokenizer")
    (status, out), = post_all(server.base_url, [plain(1)])
    assert status == 500 and "injected fault" in out["error"]["message"]
    (status, out), = post_all(server.base_url, [plain(1)])
    assert status == 200 and settled(server)


def test_a_failing_detokenizer_ends_only_its_sample(server):
    """A sample whose new token cannot be turned into text ends with an error; the request beside it does not."""
    expected = post_all(server.base_url, [plain(1)])[0][1]["choices"][0]["text"]
    faults.arm("detokenizer")
    (s1, stream), (s2, whole) = post_all(server.base_url, [{**plain(1), "stream": True}, plain(1)])
    last = stream[-1]["choices"][0]["finish_reason"] if s1 == 200 else None
    hit_the_stream = last == "error" and s2 == 200 and whole["choices"][0]["text"] == expected
    hit_the_other = s2 == 500 and last == "length"
    assert hit_the_stream or hit_the_other, (s1, stream[-1], s2, whole)
    assert settled(server)


@pytest.mark.parametrize("point", ["step", "output"])
def test_an_engine_failure_ends_every_request_and_exits_1(tiny_model_dir, point):
    """The server's own serve(): the failure reaches every open request (a 500, or an error event in a
    stream), /health turns 503, and serve() returns 1 instead of serving a dead engine."""
    engine = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), num_kv_blocks=64,
                                                  max_model_len=64, max_num_batched_tokens=64))
    sock = bind_socket("127.0.0.1", 0)
    base = f"http://127.0.0.1:{sock.getsockname()[1]}"
    seen, returned = {}, threading.Event()

    def client():
        async def go():
            async with aiohttp.ClientSession() as s:
                for _ in range(200):
                    try:
                        async with s.get(base + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        await asyncio.sleep(0.05)
                faults.arm(point)
                seen["answers"] = await asyncio.gather(
                    _post(s, base + "/v1/completions", {**plain(1), "max_tokens": 40}),
                    _post(s, base + "/v1/completions", {**plain(2), "max_tokens": 40, "stream": True}))
                async with s.get(base + "/health") as r:
                    seen["health"] = r.status
        asyncio.run(go())
        seen["failed_at"] = time.monotonic()
        if not returned.wait(15):  # (serve() did not notice: SIGTERM ends it, late)
            os.kill(os.getpid(), signal.SIGTERM)

    t = threading.Thread(target=client)
    t.start()
    try:
        status = asyncio.run(serve(engine, sock))
        returned.set()
        late = time.monotonic() - seen["failed_at"]
    finally:
        t.join(30)
        sock.close()
        engine.shutdown()
    (s1, whole), (s2, stream) = seen["answers"]
    assert s1 == 500 and whole["error"]["message"], whole
    assert s2 in (200, 500) and "error" in (stream[-1] if s2 == 200 else stream)
    assert seen["health"] == 503 and status == 1 and late < 10  # (it exited by itself, not at the SIGTERM)


def test_a_failed_disk_write_leaves_no_partial_file_and_turns_the_tier_off(tmp_path):
    t = tier(tmp_path)
    t.write(1, (1, 2, 3, 4), block(0))
    t.flush()
    with faults.armed("disk_write"):
        t.write(2, (5, 6, 7, 8), block(1))
        t.flush()
    assert not t.enabled and 2 not in t
    assert sorted(os.listdir(t.dir)) == [os.path.basename(t.path(1))]  # (the whole one; no .tmp)
    again = tier(tmp_path)  # a restart reads back only whole entries
    assert np.array_equal(again.read(1, (1, 2, 3, 4)), block(0)) and again.read(2, (5, 6, 7, 8)) is None


def test_a_restart_removes_only_stale_temporary_files(tmp_path):
    """A process killed mid-write leaves its .tmp: the next tier removes it once stale, not one being written."""
    t = tier(tmp_path)
    stale, fresh = os.path.join(t.dir, "a.kvblock.1.0.tmp"), os.path.join(t.dir, "b.kvblock.2.0.tmp")
    for p in (stale, fresh):
        with open(p, "wb") as f:
            f.write(b"partial")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    tier(tmp_path)
    assert not os.path.exists(stale) and os.path.exists(fresh)


def test_fault_points_are_checked():
    with pytest.raises(ValueError, match="not one of"):
        faults.arm("nowhere")
    with pytest.raises(ValueError, match="JAXPAGED_FAULTS"):
        faults.arm_from_env("step:x")
    faults.arm_from_env("grammar:2")
    faults.check("grammar")  # (the first passes)
    with pytest.raises(faults.InjectedFault):
        faults.check("grammar")
    faults.check("grammar")  # (once)
    with faults.armed("disk_write"), pytest.raises(OSError):
        faults.check("disk_write")

"""Data parallelism on forced CPU devices: replicas give one replica's outputs, requests spread by load and
follow the prefix cache, and aborts and finishes reach the replica holding the request."""

import asyncio
import json
import time

import aiohttp
import jax
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.distributed.workload import GREEDY, baseline, run
from tests.server.conftest import API_KEY, serving

pytestmark = pytest.mark.skipif(len(jax.devices()) < 8, reason="needs 8 devices (XLA_FLAGS, tests/conftest.py)")


@pytest.mark.parametrize("tp, dp", [(1, 2), (2, 2)])
def test_outputs_equal_one_replica(tp, dp, tiny_model_dir):
    path = tiny_model_dir("llama")
    routed = []
    assert run(path, tensor_parallel_size=tp, data_parallel_size=dp, num_kv_blocks=9,  # (a pool each: preempts)
               check=lambda llm: routed.extend(llm.engine.scheduler.num_routed)) == baseline(path)
    assert len(routed) == dp and min(routed) >= 2, f"requests were not spread: {routed}"


def test_routing_by_load_then_prefix_cache(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), data_parallel_size=2, num_kv_blocks=32, max_num_batched_tokens=32,
              compile_guard=True)
    engine = llm.engine
    router, (r0, r1) = engine.scheduler, engine.core.replicas
    rng = np.random.default_rng(3)
    long, short = rng.integers(3, 256, size=100).tolist(), rng.integers(3, 256, size=40).tolist()
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine.add_request("long", long, params)  # both idle: the first replica
    engine.add_request("short", short, params)  # the other, less loaded
    engine.add_request("short2", [7, 8, 9], params)  # still less loaded there (40 + 8 + 3 + 8 < 100 + 8)
    assert [router.holder(r) for r in ("long", "short", "short2")] == [r0, r1, r1]
    while engine.has_unfinished_requests():
        engine.step()
    hits = r1.kv_cache_manager.num_hit_tokens
    engine.add_request("again", short[:33] + [5, 6], params)  # both idle: the one holding 2 blocks of it
    assert router.holder("again") is r1
    while engine.has_unfinished_requests():
        engine.step()
    assert r1.kv_cache_manager.num_hit_tokens == hits + 32

    engine.add_request("gone", long, SamplingParams(max_tokens=300, ignore_eos=True))  # prefix cached on r0
    holder = router.holder("gone")
    assert holder is r0
    engine.step()
    assert holder.kv_cache_manager.num_free_blocks < 31
    engine.abort_request("gone")
    engine.abort_request("unknown")
    assert holder.kv_cache_manager.num_free_blocks == 31 and not engine.has_unfinished_requests()


def test_server_over_two_replicas(tiny_model_dir):
    """Streamed and plain completions through the OpenAI server equal one engine's; clients that hang up free
    their blocks on whichever replica held them."""
    path = tiny_model_dir("llama")
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 256, size=n).tolist() for n in (3, 20, 45, 70)]
    want = [o.outputs[0].text for o in LLM(path, max_num_batched_tokens=128, max_model_len=256).generate(
        [{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)]

    async def complete(base, session, prompt, stream):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": GREEDY.max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": stream}
        async with session.post(base + "/v1/completions", json=body) as r:
            assert r.status == 200
            if not stream:
                return (await r.json())["choices"][0]["text"]
            text = ""
            async for line in r.content:
                if line.startswith(b"data: {"):
                    text += json.loads(line[6:])["choices"][0]["text"]
            return text

    async def hang_up(base, session, prompt):
        body = {"model": "tiny", "prompt": prompt, "max_tokens": 150, "ignore_eos": True, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as r:
            async for _ in r.content:
                break

    with serving(path, data_parallel_size=2) as server:
        engine = server.engine.engine

        async def go():
            async with aiohttp.ClientSession(headers={"Authorization": f"Bearer {API_KEY}"}) as s:
                got = await asyncio.gather(*(complete(server.base_url, s, p, stream=i % 2 == 1)
                                             for i, p in enumerate(prompts)))
                await asyncio.gather(*(hang_up(server.base_url, s, p) for p in prompts))
                return got

        got = asyncio.run(go())
        assert got == want
        assert engine.scheduler.num_routed[0] > 0 and engine.scheduler.num_routed[1] > 0
        for _ in range(200):
            if not engine.has_unfinished_requests() and all(
                    c.kv_cache_manager.num_free_blocks == c.kv_cache_manager.pool.num_blocks - 1
                    for c in engine.core.replicas):
                break
            time.sleep(0.02)
        assert not engine.has_unfinished_requests()
        for core in engine.core.replicas:
            assert core.kv_cache_manager.num_free_blocks == core.kv_cache_manager.pool.num_blocks - 1
        pools = [core.runner.kv_pool for core in engine.core.replicas]
    assert all(pool.is_deleted() for pool in pools)  # (the stopped server freed every replica's pool)

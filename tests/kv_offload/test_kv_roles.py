"""Prefill/decode disaggregation on the engine (`kv_role`): a producer writes each finished request's blocks to the
shared folder at once; a consumer sharing the folder loads a prompt's blocks from there instead of computing
them, with greedy outputs identical to one engine doing both; nothing leaks on either side."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs

RNG = np.random.default_rng(5)
PROMPTS = [RNG.integers(3, 256, size=n).tolist() for n in (40, 150, 7)]  # 2 blocks, chunked (> 64), < 1 block
KW = dict(num_kv_blocks=48, max_num_batched_tokens=64, max_model_len=256, compile_guard=True)
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def tokens(llm: LLM, prompts, params=GREEDY) -> list[list[list[int]]]:
    return [[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), **KW)
    return tokens(llm, PROMPTS), tokens(llm, PROMPTS[:1], SamplingParams(n=3, temperature=0.8, seed=3,
                                                                          max_tokens=6))


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_consumer_loads_the_producers_blocks(tiny_model_dir, tmp_path, expected, async_scheduling):
    path = tiny_model_dir("llama")
    producer = LLM(path, kv_role="producer", kv_offload_dir=str(tmp_path), async_scheduling=async_scheduling, **KW)
    tokens(producer, PROMPTS, SamplingParams(temperature=0, max_tokens=1))  # (what the proxy sends a prefill)
    kv = producer.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks - 1  # nothing held after the requests ended
    files = len(list(tmp_path.rglob("*.kvblock")))
    assert files == 40 // 16 + 150 // 16  # every full prompt block, written before generate returned

    consumer = LLM(path, kv_role="consumer", kv_offload_dir=str(tmp_path), **KW)
    before = consumer.engine.stats.num_prompt_tokens
    assert tokens(consumer, PROMPTS) == expected[0]
    offload = consumer.engine.core.offload.stats()
    assert offload["disk_hit_blocks"] == files
    assert consumer.engine.stats.num_prompt_tokens - before == sum(len(p) for p in PROMPTS) - 16 * files
    assert tokens(consumer, PROMPTS[:1], SamplingParams(n=3, temperature=0.8, seed=3, max_tokens=6)) == expected[1]
    kv = consumer.engine.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert len(list(tmp_path.rglob("*.kvblock"))) == files  # (a consumer writes nothing it was not asked to)


def test_more_finished_blocks_than_host_slots_and_blocks_kept_in_host_memory(tiny_model_dir, tmp_path):
    """Four prompts of 6 full blocks finishing in one step: 24 blocks through 16 host slots; then, their files
    gone (another engine's budget removed them), the same prompts again: written from the host tier."""
    prompts = [RNG.integers(3, 256, size=100).tolist() for _ in range(4)]
    producer = LLM(tiny_model_dir("llama"), kv_role="producer", kv_offload_dir=str(tmp_path),
                   **{**KW, "max_num_batched_tokens": 512})
    one = SamplingParams(temperature=0, max_tokens=1)
    tokens(producer, prompts, one)
    assert producer.engine.core.offload.host.num_slots == 16
    files = sorted(tmp_path.rglob("*.kvblock"))
    assert len(files) == 4 * (100 // 16)
    for f in files:
        f.unlink()
    tokens(producer, prompts, one)
    assert sorted(tmp_path.rglob("*.kvblock")) == files


def test_without_a_producer_nothing_is_in_the_folder(tiny_model_dir, tmp_path):
    """The same run with a plain engine in place of the producer: its blocks stay on its device (so the test
    above measures the role, not the offload tier's eviction path)."""
    plain = LLM(tiny_model_dir("llama"), kv_offload_dir=str(tmp_path), **KW)
    tokens(plain, PROMPTS, SamplingParams(temperature=0, max_tokens=1))
    plain.engine.flush_kv_offload()
    assert not list(tmp_path.rglob("*.kvblock"))


def test_kv_role_is_checked():
    with pytest.raises(ValueError, match="kv_role='producer' needs kv_offload_dir"):
        EngineArgs(kv_role="producer").validate()
    with pytest.raises(ValueError, match="kv_role must be one of producer, consumer, both"):
        EngineArgs(kv_role="prefill", kv_offload_dir="/tmp/x").validate()

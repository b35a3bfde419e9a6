"""End to end on a tiny model: a prefix pushed out of the device pool comes back from the host tier, then from
the disk tier (after the host tier lost it, and after a restart), with greedy outputs identical to an engine that
never lost it; corrupt files are recomputed around; the metrics count each tier."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams

RNG = np.random.default_rng(11)
PREFIX = RNG.integers(3, 256, size=70).tolist()  # 4 full blocks of 16 and a bit
FILLERS = [RNG.integers(3, 256, size=60).tolist() for _ in range(4)]
PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def expected(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=64, compile_guard=True)
    return {tail: llm.generate([PREFIX + [tail]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids
            for tail in (4, 5, 6)}


def small_engine(path: str, **kw) -> LLM:
    """12 blocks: the prefix's cached blocks are evicted by the fillers."""
    return LLM(path, num_kv_blocks=12, max_num_batched_tokens=64, max_model_len=128, compile_guard=True, **kw)


def push_out(llm: LLM) -> None:
    for f in FILLERS:
        llm.generate([f], PARAMS, use_tqdm=False)


def answer(llm: LLM, tail: int) -> list[int]:
    return llm.generate([PREFIX + [tail]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_host_tier_brings_back_an_evicted_prefix(tiny_model_dir, expected, async_scheduling):
    llm = small_engine(tiny_model_dir("llama"), kv_offload_host_gb=0.01, async_scheduling=async_scheduling)
    assert answer(llm, 4) == expected[4]
    push_out(llm)
    kv = llm.engine.kv_cache_manager
    assert not kv.get_computed_blocks(llm.engine.make_requests("x", PREFIX + [5], PARAMS)[2][0])  # gone from device
    assert answer(llm, 5) == expected[5]
    stats = llm.engine.core.offload.stats()
    assert stats["host_hit_blocks"] == 4 and stats["loaded_blocks"] == 4
    text = llm.engine.metrics.render().decode()
    assert 'jaxpaged:kv_offload_hits_total{tier="host"} 4.0' in text
    assert kv.num_free_blocks == kv.pool.num_blocks - 1


def test_without_the_tier_the_prefix_is_recomputed(tiny_model_dir, expected):
    """The same schedule without offload: nothing is loaded and every prompt token is computed again (so the
    tier tests above measure the tier, not a device-cache hit)."""
    llm = small_engine(tiny_model_dir("llama"))
    answer(llm, 4)
    push_out(llm)
    before = llm.engine.stats.num_prompt_tokens
    assert answer(llm, 5) == expected[5]
    assert llm.engine.stats.num_prompt_tokens - before == len(PREFIX) + 1


def test_disk_tier_after_the_host_tier_lost_it_and_after_a_restart(tiny_model_dir, expected, tmp_path, caplog):
    path = tiny_model_dir("llama")
    llm = small_engine(path, kv_offload_dir=str(tmp_path))  # a host tier of 8 blocks (128 / 16): staging only
    assert answer(llm, 4) == expected[4]
    push_out(llm)
    push_out(llm)  # more blocks than the host tier holds: the prefix is on disk only
    llm.engine.flush_kv_offload()
    offload = llm.engine.core.offload
    assert offload.host.num_slots == 8 and len(offload.disk.index) >= 4
    before, disk_hits = llm.engine.stats.num_prompt_tokens, offload.stats()["disk_hit_blocks"]
    assert answer(llm, 5) == expected[5]
    assert offload.stats()["disk_hit_blocks"] - disk_hits == 4
    assert llm.engine.stats.num_prompt_tokens - before == len(PREFIX) + 1 - 64  # 4 blocks not recomputed
    llm.engine.flush_kv_offload()

    restarted = small_engine(path, kv_offload_dir=str(tmp_path))
    assert answer(restarted, 6) == expected[6]
    assert restarted.engine.core.offload.stats()["disk_hit_blocks"] == 4
    assert 'jaxpaged:kv_offload_hits_total{tier="disk"} 4.0' in restarted.engine.metrics.render().decode()

    # a corrupt file (the prefix's third block): the first two load, the rest is recomputed
    disk = restarted.engine.core.offload.disk
    req = restarted.engine.make_requests("y", PREFIX + [4], PARAMS)[2][0]
    hashes = restarted.engine.kv_cache_manager._block_hashes(req, 64)
    target = disk.path(hashes[2])
    with open(target, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xff\xff")
    third = small_engine(path, kv_offload_dir=str(tmp_path))
    with caplog.at_level(logging.WARNING):
        assert answer(third, 4) == expected[4]
    assert "checksum mismatch" in caplog.text and not os.path.exists(target)
    assert third.engine.core.offload.stats()["disk_hit_blocks"] == 2


def test_offload_settings_are_checked_before_loading(tiny_model_dir):
    path = tiny_model_dir("llama")
    with pytest.raises(ValueError, match="kv_offload_host_gb"):
        LLM(path, kv_offload_host_gb=-1)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        LLM(path, kv_offload_host_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="kv_offload_disk_gb"):
        LLM(path, kv_offload_dir="/tmp/x", kv_offload_disk_gb=0)

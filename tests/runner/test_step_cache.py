"""The step cache (`runner/step_cache.py`): an engine whose steps are on disk does not trace the model, and
generates what a traced engine does; a damaged entry, another configuration or other code is traced again."""

from __future__ import annotations

import logging
import os

import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.runner import device_step, step_cache

KW = dict(max_num_batched_tokens=32, max_num_seqs=4, kv_cache_memory="2MiB", compile_guard=True)
PROMPTS = [[1, 5, 9, 13, 2], list(range(3, 50)), [7] * 20]


def engine(path, **kw) -> LLM:
    """An engine with every step loaded (the cached ones load in the background after warmup)."""
    llm = LLM(path, **{**KW, **kw})
    llm.engine.core.runner.wait_for_steps()
    return llm


def greedy(llm) -> list[list[int]]:
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True), use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture
def traces(monkeypatch):
    """How many times the model's step has been traced."""
    count = [0]
    real = device_step.device_step

    def counted(*args, **kwargs):
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(device_step, "device_step", counted)
    return count


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("JAXPAGED_STEP_CACHE", str(tmp_path / "steps"))
    return tmp_path / "steps"


def entries(root) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*.bin"))


def test_cached_steps_are_not_traced_and_match(tiny_model_dir, cache_dir, traces, monkeypatch):
    path = tiny_model_dir("llama")
    monkeypatch.setenv("JAXPAGED_STEP_CACHE", "off")
    plain = engine(path)
    buckets = len(plain.engine.core.runner.buckets)
    expected = greedy(plain)
    assert traces[0] == buckets and not cache_dir.exists()

    monkeypatch.setenv("JAXPAGED_STEP_CACHE", str(cache_dir))
    first = engine(path)  # traces each bucket once and keeps it
    assert traces[0] == 2 * buckets and len(entries(cache_dir)) == buckets
    assert greedy(first) == expected
    second = LLM(path, **KW)  # (steps loading in the background: generating waits for each one it needs)
    pool = second.engine.core.runner.kv_pool.unsafe_buffer_pointer()
    assert greedy(second) == expected  # (compile guard on: and nothing compiled while generating)
    assert second.engine.core.runner.kv_pool.unsafe_buffer_pointer() == pool  # updated in place (donated)
    second.engine.core.runner.wait_for_steps()
    assert traces[0] == 2 * buckets, "a cached step was traced"


def test_damaged_entry_is_traced_again(tiny_model_dir, cache_dir, traces, caplog):
    path = tiny_model_dir("llama")
    expected = greedy(engine(path))
    first = traces[0]
    victim = sorted(cache_dir.rglob("*.bin"))[0]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        llm = engine(path)  # (the damaged step is traced on a background thread)
    assert traces[0] == first + 1  # only the damaged bucket
    assert "checksum mismatch" in caplog.text
    assert greedy(llm) == expected
    engine(path)  # the entry was replaced: nothing is traced
    assert traces[0] == first + 1


def test_other_configuration_or_code_is_traced_again(tiny_model_dir, cache_dir, traces, monkeypatch):
    path = tiny_model_dir("llama")
    engine(path)
    buckets = traces[0]
    engine(path, max_num_seqs=8)  # another configuration: another key
    assert traces[0] == 2 * buckets and len(os.listdir(cache_dir)) == 2
    monkeypatch.setattr(step_cache, "source_digest", lambda: "edited")
    engine(path)  # other code: another key
    assert traces[0] == 3 * buckets and len(os.listdir(cache_dir)) == 3
    monkeypatch.setenv("JAXPAGED_PALLAS_ATTENTION", "num_splits=2")
    engine(path)  # another attention variant read at trace time: another key
    assert traces[0] == 4 * buckets and len(os.listdir(cache_dir)) == 4


def test_a_read_only_cache_is_used_and_not_written(tiny_model_dir, cache_dir, traces, caplog, monkeypatch):
    path = tiny_model_dir("llama")
    expected = greedy(engine(path))
    buckets = traces[0]
    (key,) = cache_dir.iterdir()
    victim = sorted(key.glob("*.bin"))[0]
    victim.unlink()  # one bucket missing: traced, and cannot be kept

    def read_only(*args, **kwargs):
        raise PermissionError("read-only file system")

    monkeypatch.setattr(step_cache.tempfile, "mkstemp", read_only)
    monkeypatch.setattr(step_cache.os, "utime", read_only)
    with caplog.at_level(logging.WARNING):
        llm = engine(path)
    assert greedy(llm) == expected
    assert traces[0] == buckets + 1 and not victim.exists()  # the others loaded; the missing one traced once
    assert "could not keep the traced step" in caplog.text and "unusable" not in caplog.text


def test_prune_keeps_the_newest_keys_and_nothing_else(tmp_path):
    def key(i: int) -> str:
        return f"{i:032x}"

    for i in range(step_cache.KEEP + 3):
        d = tmp_path / key(i)
        d.mkdir()
        os.utime(d, (1000 + i, 1000 + i))
    (tmp_path / "xla").mkdir()  # a folder that is not a key (a shared cache folder): never pruned
    os.utime(tmp_path / "xla", (1, 1))
    cache = step_cache.StepCache(tmp_path, "what", ())
    cache.dir.mkdir()
    cache._prune()
    kept = sorted(p.name for p in tmp_path.iterdir())
    assert cache.dir.name in kept and "xla" in kept and len(kept) == step_cache.KEEP + 1
    assert key(0) not in kept and key(step_cache.KEEP + 2) in kept


def test_off_by_default_with_the_compilation_cache_off(monkeypatch, tmp_path):
    monkeypatch.delenv("JAXPAGED_STEP_CACHE", raising=False)
    monkeypatch.setenv("JAXPAGED_COMPILATION_CACHE", "off")
    assert step_cache.step_cache_dir() is None
    monkeypatch.setenv("JAXPAGED_COMPILATION_CACHE", str(tmp_path / "xla"))
    assert step_cache.step_cache_dir() == tmp_path / "xla-steps"
    monkeypatch.setenv("JAXPAGED_STEP_CACHE", "off")
    assert step_cache.step_cache_dir() is None

"""The engine with the device step stubbed out (`jaxpaged bench host`): its host path must still be right."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import SamplingParams
from jaxpaged.bench.dummy_model import write_dummy_model
from jaxpaged.bench.host import PHASES, measure
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import RequestOutputKind


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    return write_dummy_model(str(tmp_path_factory.mktemp("dummy")), "tiny")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_stub_engine_runs_every_request_to_its_length(dummy_dir, async_scheduling):
    """Chunked prefills, preemption (a small pool), prefix hits and n > 1 on the stub: every request ends with
    exactly its max_tokens tokens (the stub draws 7), and every block and row comes back."""
    engine = LLMEngine.from_engine_args(EngineArgs(model=dummy_dir, max_num_seqs=8, max_num_batched_tokens=32,
                                                   max_model_len=128, num_kv_blocks=12,
                                                   async_scheduling=async_scheduling), stub=True)
    rng = np.random.default_rng(0)
    lengths = {}
    shared = rng.integers(3, 500, size=20).tolist()
    for i in range(12):
        prompt = (shared if i % 3 == 0 else []) + rng.integers(3, 500, size=int(rng.integers(4, 60))).tolist()
        lengths[str(i)] = int(rng.integers(1, 20))
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=lengths[str(i)], ignore_eos=True, n=1 + i % 2),
                           output_kind=RequestOutputKind.FINAL_ONLY)
    done = {}
    for _ in range(2000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            assert out.finished
            done[out.request_id] = out
    assert sorted(done) == sorted(lengths)
    for rid, out in done.items():
        assert [o.token_ids for o in out.outputs] == [[7] * lengths[rid]] * len(out.outputs)
        assert all(o.finish_reason == "length" for o in out.outputs)
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.num_hit_tokens > 0
    kv = engine.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    assert engine.step() == [] and len(engine.runner.batch) == 0  # the next step frees the last rows


def test_bench_host_reports_each_phase(dummy_dir):
    r = measure(num_seqs=16, steps=3, model_dir=dummy_dir)
    assert r["num_seqs"] == 16 and r["mean_ms"] > 0 and all(r[f"{p}_ms"] >= 0 for p in PHASES)

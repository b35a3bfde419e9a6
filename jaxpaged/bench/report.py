"""The benchmarks' shared results: a summary row per engine, its table, and the JSON file."""

from __future__ import annotations

import json
import os

from jaxpaged.bench.workload import BenchRequest


def summarize(backend: str, reqs: list[BenchRequest], wall: float, warmup: float, **extra) -> dict:
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs)
    output_tokens = sum(r.output_len for r in reqs)
    return {
        "backend": backend, "num_requests": len(reqs), "wall_s": wall, "warmup_s": warmup,
        "requests_per_s": len(reqs) / wall, "output_tokens_per_s": output_tokens / wall,
        "total_tokens_per_s": (prompt_tokens + output_tokens) / wall,
        "prompt_tokens": prompt_tokens, "output_tokens": output_tokens, **extra,
    }


def print_table(results: list[dict]) -> None:
    cols = [("backend", "{:>26}"), ("requests_per_s", "{:.2f}"), ("output_tokens_per_s", "{:.1f}"),
            ("total_tokens_per_s", "{:.1f}"), ("wall_s", "{:.1f}"), ("warmup_s", "{:.1f}"),
            ("peak_kv_blocks_used", "{}")]
    print("\n" + " | ".join(f"{c:>20}" for c, _ in cols))
    print("-" * (23 * len(cols)))
    for r in results:
        print(" | ".join(f"{fmt.format(r[c]) if c in r else '-':>20}" for c, fmt in cols))
    if len(results) == 2:
        ratio = results[0]["output_tokens_per_s"] / results[1]["output_tokens_per_s"]
        print(f"\n{results[0]['backend']} / {results[1]['backend']} output tokens/s: {ratio:.2f}x")
        a, b = (r.get("peak_kv_blocks_used") for r in results)
        if a is not None and b:
            print(f"peak KV blocks: {a} vs {b} ({1 - a / b:.0%} fewer)")


def write_json(results: list[dict] | dict, path: str | None) -> None:
    """Write the results to `path` (folders made as needed); nothing when it is empty."""
    if not path:
        return
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {path}")

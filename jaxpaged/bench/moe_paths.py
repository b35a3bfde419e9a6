"""The two expert paths of `layers.dense.moe_mlp` timed against each other on this machine: the grouped matmul
(`lax.ragged_dot`, the default off CPUs) and every expert batched (the CPU default). Prints a table and writes
JSON: `python -m jaxpaged.bench.moe_paths [--output moe_paths.json]`."""

from __future__ import annotations

import argparse
import time

import jax
import numpy as np

from jaxpaged.bench.report import write_json
from jaxpaged.layers.dense import moe_mlp

# (tokens, hidden, experts, expert ffn, top-k): decode-sized to prefill-sized steps, Mixtral-like and many-expert
SHAPES = [(8, 576, 8, 1536, 2), (64, 576, 8, 1536, 2), (256, 576, 8, 1536, 2), (8, 512, 32, 256, 4),
          (64, 512, 32, 256, 4)]


def time_ms(fn, *args, repeats: int = 7) -> float:
    fn(*args).block_until_ready()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn(*args).block_until_ready()
        times.append(time.perf_counter() - t)
    return 1e3 * float(np.median(times))


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--output", default=None, help="JSON file for the rows (default: none)")
    ns = ap.parse_args(argv)
    rows = []
    print(f"{'tokens':>6} {'hidden':>6} {'experts':>7} {'ffn':>5} {'top-k':>5} {'grouped ms':>10} {'batched ms':>10}"
          f" {'grouped/batched':>15}")
    for t, e, x, f, k in SHAPES:
        key = jax.random.PRNGKey(0)
        args = (jax.random.normal(key, (t, e)), 0.1 * jax.random.normal(key, (e, x)),
                0.02 * jax.random.normal(key, (x, e, 2 * f)), 0.02 * jax.random.normal(key, (x, f, e)))
        ms = {g: time_ms(jax.jit(lambda *a, g=g, k=k: moe_mlp(*a, top_k=k, normalize=True, grouped=g)), *args)
              for g in (True, False)}
        row = dict(tokens=t, hidden=e, experts=x, ffn=f, top_k=k, grouped_ms=ms[True], batched_ms=ms[False],
                   platform=jax.default_backend())
        rows.append(row)
        print(f"{t:>6} {e:>6} {x:>7} {f:>5} {k:>5} {ms[True]:>10.1f} {ms[False]:>10.1f} {ms[True] / ms[False]:>14.1f}x")
    write_json(rows, ns.output)
    return rows


if __name__ == "__main__":
    main()

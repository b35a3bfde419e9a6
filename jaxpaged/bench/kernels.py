"""Kernel benchmark: each Pallas kernel against its plain-JAX reference at serving shapes.

    jaxpaged bench kernels                 # GPU: Triton kernels at full serving shapes
    jaxpaged bench kernels                 # CPU: the C++ CPU attention at full shapes (Pallas sampler interpreted)
    jaxpaged bench kernels --quick         # small shapes (a CPU without the C++ kernel: kernels interpreted)
    jaxpaged bench kernels --only dense    # CPU: dense layers on packed weights against XLA's dot

Correctness first (the kernel's output against the reference on the same inputs), then the median
time of each. Attention reports the K/V bytes its sequences' contexts hold per second of kernel
time; sampling reports rows (tokens) per second; the CPU dense call GFLOP/s over a model's matmuls.
Prints a table and writes JSON (--output-json).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.config import platform_is_gpu
from pallas_kernels import cpu_attention, cpu_dense
from pallas_kernels.paged_attention import ragged_paged_attention, reference_ragged_paged_attention
from pallas_kernels.sampling import reference_top_k_top_p_sampling, top_k_top_p_mask, top_k_top_p_sampling

MODEL_SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim


def median_ms(fn, *args, iters: int) -> float:
    """Median wall time of fn(*args) in ms over `iters` runs after one warm-up (compile) run."""
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return 1e3 * float(np.median(times))


def attention_case(seqs: list[tuple[int, int]], heads: int, kv_heads: int, d: int, dtype, block_size: int = 16,
                   seed: int = 0):
    """Random pool, shuffled block tables and a ragged step: seqs = [(context_len, new_tokens)]."""
    rng = np.random.default_rng(seed)
    width = -(-max(c + n for c, n in seqs) // 128) * 128 // block_size  # the reference reads 128-token chunks
    num_blocks = 1 + sum(-(-(c + n) // block_size) for c, n in seqs)
    perm = rng.permutation(np.arange(1, num_blocks)).astype(np.int32)
    tables = np.zeros((len(seqs), width), np.int32)
    token_seq, positions, used = [], [], 0
    for i, (c, n) in enumerate(seqs):
        nb = -(-(c + n) // block_size)
        tables[i, :nb] = perm[used:used + nb]
        used += nb
        token_seq += [i] * n
        positions += list(range(c, c + n))
    t = len(token_seq)
    pool = jnp.asarray(rng.standard_normal((1, 2, num_blocks, block_size, kv_heads, d), np.float32), dtype)
    q = jnp.asarray(rng.standard_normal((t, heads, d), np.float32), dtype)
    kv_bytes = sum(c + n for c, n in seqs) * 2 * kv_heads * d * jnp.dtype(dtype).itemsize
    return (q, pool, jnp.int32(0), jnp.asarray(tables), jnp.asarray(token_seq, jnp.int32),
            jnp.asarray(positions, jnp.int32)), kv_bytes


def bench_attention(quick: bool, iters: int, interpret: bool, dtype, backend: str = "pallas") -> list[dict]:
    """backend "pallas": the Triton kernel (interpreted off GPU); "cpu": the C++ CPU kernel."""
    scale = 8 if quick else 1
    workloads = {
        "decode": [(1024 // scale, 1)] * (64 // scale),
        "mixed": [(512 // scale, 1)] * (16 // scale) + [(256 // scale, 256 // scale), (0, 512 // scale)],
    }
    rows = []
    for model, (h, kh, d) in MODEL_SHAPES.items():
        for name, seqs in workloads.items():
            args, kv_bytes = attention_case(seqs, h, kh, d, dtype)
            sm = d ** -0.5
            if backend == "cpu":
                kern = jax.jit(lambda *a, sm=sm: cpu_attention.ragged_paged_attention_cpu(*a, sm_scale=sm))
            else:
                kern = jax.jit(lambda *a, sm=sm: ragged_paged_attention(*a, sm_scale=sm, interpret=interpret))
            ref = jax.jit(lambda *a, sm=sm: reference_ragged_paged_attention(*a, sm_scale=sm))
            err = float(jnp.max(jnp.abs(kern(*args).astype(jnp.float32) - ref(*args).astype(jnp.float32))))
            k_ms, r_ms = median_ms(kern, *args, iters=iters), median_ms(ref, *args, iters=iters)
            rows.append({"kernel": "paged_attention" if backend == "pallas" else "cpu_attention",
                         "case": f"{model} {name}", "tokens": int(args[0].shape[0]),
                         "max_abs_err": err, "kernel_ms": k_ms, "reference_ms": r_ms, "speedup": r_ms / k_ms,
                         "kernel_kv_GBps": kv_bytes / k_ms / 1e6, "reference_kv_GBps": kv_bytes / r_ms / 1e6})
    return rows


def bench_sampling(quick: bool, iters: int, interpret: bool) -> list[dict]:
    batch = 8 if quick else 64
    rows = []
    for vocab in (49_152, 128_256):
        logits = jax.random.normal(jax.random.PRNGKey(vocab), (batch, vocab), jnp.float32) * 3
        keys = jax.random.split(jax.random.PRNGKey(1), batch)
        for name, k, p in (("top-k 50 + top-p 0.9", 50, 0.9), ("top-p 0.9", 0, 0.9), ("top-k 50", 50, 1.0)):
            temp, top_k, top_p = jnp.full(batch, 0.8), jnp.full(batch, k, jnp.int32), jnp.full(batch, p)
            kern = jax.jit(lambda *a: top_k_top_p_sampling(*a, interpret=interpret))
            ref = jax.jit(reference_top_k_top_p_sampling)
            tok = kern(logits, keys, temp, top_k, top_p)
            kept = top_k_top_p_mask(logits / 0.8, top_k, top_p) > -jnp.inf
            outside = int(jnp.sum(~jnp.take_along_axis(kept, tok[:, None], axis=1)))
            k_ms = median_ms(kern, logits, keys, temp, top_k, top_p, iters=iters)
            r_ms = median_ms(ref, logits, keys, temp, top_k, top_p, iters=iters)
            rows.append({"kernel": "sampling", "case": f"V={vocab} {name}", "tokens": batch,
                         "draws_outside_kept_set": outside, "kernel_ms": k_ms, "reference_ms": r_ms,
                         "speedup": r_ms / k_ms, "kernel_tokens_per_s": batch / k_ms * 1e3,
                         "reference_tokens_per_s": batch / r_ms * 1e3})
    return rows


# SmolLM2-135M's matmuls per layer, (K, N): q/k/v fused, o, gate/up fused, down
DENSE_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def bench_dense(quick: bool, iters: int) -> list[dict]:
    """The CPU dense call on packed weights against XLA's dot on the same float32 weights: a chain of SmolLM2's
    four matmuls over its 30 layers (2 with --quick), each layer's weights its own (as the model reads them)."""
    layers = 2 if quick else 30
    rng = np.random.default_rng(0)
    weights = [rng.standard_normal(shape, np.float32) / np.sqrt(shape[0]) for _ in range(layers)
               for shape in DENSE_SHAPES]
    plain = [jnp.asarray(w) for w in weights]
    packed = [jnp.asarray(cpu_dense.pack(w)) for w in weights]
    flops_per_row = 2 * layers * sum(k * n for k, n in DENSE_SHAPES)

    def chain(dot):
        def run(x, ws):
            out = []
            for i in range(0, len(ws), 4):
                c = dot(x, ws[i + 2])
                out += [dot(x, ws[i]), dot(x, ws[i + 1]), dot(c[:, :DENSE_SHAPES[3][0]], ws[i + 3])]
            return out
        return jax.jit(run)

    kern, ref = chain(cpu_dense.packed_dense), chain(lambda x, w: x @ w)
    rows = []
    for m in (8, 64) if quick else (8, 16, 32, 64, 128, 256, 512):
        x = jnp.asarray(rng.standard_normal((m, DENSE_SHAPES[0][0]), np.float32))
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(kern(x, packed), ref(x, plain)))
        k_ms, r_ms = median_ms(kern, x, packed, iters=iters), median_ms(ref, x, plain, iters=iters)
        rows.append({"kernel": "cpu_dense", "case": f"smollm2 x{layers} layers, {m} rows", "tokens": m,
                     "max_rel_err": err, "kernel_ms": k_ms, "reference_ms": r_ms, "speedup": r_ms / k_ms,
                     "kernel_GFLOPs": flops_per_row * m / k_ms / 1e6,
                     "reference_GFLOPs": flops_per_row * m / r_ms / 1e6})
    return rows


def print_table(rows: list[dict], device: str) -> None:
    print(f"\nKernels vs references on {device}")
    print(f"{'kernel':<16}{'case':<30}{'check':>12}{'kernel ms':>11}{'ref ms':>10}{'speedup':>9}  throughput")
    for r in rows:
        if r["kernel"] in ("paged_attention", "cpu_attention"):
            check = f"{r['max_abs_err']:.1e}"
            tput = f"{r['kernel_kv_GBps']:.1f} GB/s K/V (ref {r['reference_kv_GBps']:.1f})"
        elif r["kernel"] == "cpu_dense":
            check = f"{r['max_rel_err']:.1e} rel"
            tput = f"{r['kernel_GFLOPs']:.0f} GFLOP/s (ref {r['reference_GFLOPs']:.0f}: XLA's dot)"
        else:
            check = f"{r['draws_outside_kept_set']} outside"
            tput = f"{r['kernel_tokens_per_s']:,.0f} tok/s (ref {r['reference_tokens_per_s']:,.0f})"
        print(f"{r['kernel']:<16}{r['case']:<30}{check:>12}{r['kernel_ms']:>11.3f}{r['reference_ms']:>10.3f}"
              f"{r['speedup']:>8.2f}x  {tput}")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small shapes (default off GPU: kernels are interpreted)")
    p.add_argument("--iters", type=int, default=None, help="timed runs per case (default 20 on GPU, 2 off)")
    p.add_argument("--only", choices=("attention", "sampling", "dense"), default=None,
                   help="one kernel (dense: the CPU dense call, on a CPU that builds it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="q and KV pool dtype (default: bfloat16 on GPU, float32 off GPU)")
    p.add_argument("--output-json", default="bench_results/kernels.json")


def main(ns: argparse.Namespace) -> list[dict]:
    gpu = platform_is_gpu()
    interpret = not gpu
    quick = ns.quick or not gpu
    cpu_kernel = jax.default_backend() == "cpu" and cpu_attention.available()  # full shapes unless --quick
    iters = ns.iters or (20 if gpu else 2)
    device = jax.devices()[0].device_kind + (" (Triton)" if gpu else " (attention: the C++ CPU kernel; sampling: "
                                             "Pallas interpreter, times are not kernel speed)" if cpu_kernel
                                             else " (Pallas interpreter: times are not kernel speed)")
    dtype = jnp.dtype(ns.dtype or ("bfloat16" if gpu else "float32"))
    rows = []
    if ns.only in (None, "attention"):
        rows += bench_attention(ns.quick if cpu_kernel else quick, ns.iters or (10 if cpu_kernel else iters),
                                interpret, dtype, "cpu" if cpu_kernel else "pallas")
    if ns.only in (None, "sampling"):
        rows += bench_sampling(quick, iters, interpret)
    if ns.only in (None, "dense") and jax.default_backend() == "cpu" and cpu_dense.panel():
        rows += bench_dense(ns.quick, ns.iters or 10)
    print_table(rows, device)
    if ns.output_json:
        os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
        with open(ns.output_json, "w") as f:
            json.dump({"device": device, "dtype": jnp.dtype(dtype).name, "quick": quick,
                       "attention_quick": ns.quick if cpu_kernel else quick, "rows": rows}, f, indent=2)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    main(parser.parse_args())

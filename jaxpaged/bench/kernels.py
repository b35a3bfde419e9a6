"""Kernel benchmark: each Pallas kernel against its plain-JAX reference at serving shapes.

    jaxpaged bench kernels                 # GPU: Triton kernels at full serving shapes
    jaxpaged bench kernels                 # CPU: the C++ CPU attention at full shapes (Pallas sampler interpreted)
    jaxpaged bench kernels --quick         # small shapes (a CPU without the C++ kernel: kernels interpreted)
    jaxpaged bench kernels --only dense    # CPU: dense layers on packed weights against XLA's dot

Correctness first (the kernel's output against the reference on the same inputs), then the median
time of each. The run first measures the device's two ceilings (`device_ceilings`: a large copy's
bandwidth and a large matmul's rate) and reports each kernel against them. Attention: the K/V bytes
its sequences' contexts hold per second of kernel time and that as a share of the copy bandwidth
(decode is bound by it), and causal FLOPs per second as a share of the matmul rate (prefill is bound
by it); on a GPU, decode at 64 / 256 / 512 sequences of 1k and 8k tokens, a mixed step and a long
prefill, at SmolLM2's and Llama-3-8B's heads. Sampling: rows (tokens) per second and the logits'
bytes per second. The CPU dense call: GFLOP/s over a model's matmuls. Prints a table and writes
JSON (--output-json) after every case, so a run cut short keeps what it measured. Each time is the median
per call of calls dispatched back to back (`device_ceilings.median_ms`), on a GPU over input copies that
together outgrow its L2 cache.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Iterator

import jax
import jax.numpy as jnp
import numpy as np

from jaxpaged.bench import device_ceilings
from jaxpaged.bench.device_ceilings import median_ms
from jaxpaged.config import platform_is_gpu
from pallas_kernels import cpu_attention, cpu_dense
from pallas_kernels.paged_attention import ragged_paged_attention, reference_ragged_paged_attention
from pallas_kernels.sampling import reference_top_k_top_p_sampling, top_k_top_p_mask, top_k_top_p_sampling

MODEL_SHAPES = {"smollm2-135m": (9, 3, 64), "llama3-8b": (32, 8, 128)}  # query heads, KV heads, head_dim
CACHE_SPAN_BYTES = 256 << 20  # on a GPU, a case's inputs are rotated among copies spanning this (4x an H200's L2)


def copies_past_cache(nbytes: int) -> int:
    """How many input sets of nbytes the timing cycles through so that together they span CACHE_SPAN_BYTES."""
    return max(1, min(8, -(-CACHE_SPAN_BYTES // max(nbytes, 1))))


def causal_flops(seqs: list[tuple[int, int]], heads: int, d: int) -> int:
    """FLOPs of attention over what each token sees (context plus the new tokens up to itself): QK^T and PV,
    2 * d each per (query head, visible key)."""
    visible = sum(n * c + n * (n + 1) // 2 for c, n in seqs)
    return 4 * heads * d * visible


def attention_workloads(gpu_shapes: bool, quick: bool) -> dict[str, list[tuple[int, int]]]:
    """name -> [(context_len, new_tokens)] per sequence. GPU: decode at 64 / 256 / 512 sequences of 1k and 8k
    tokens, a mixed step (16 decodes, a prefill chunk over a cached prefix, a fresh prompt) and a long prefill
    (4 prompts of 2,048 tokens); CPU: decode 64 x 1k, mixed, prefill 2 x 512; quick: each 8x smaller."""
    if gpu_shapes and not quick:
        work = {f"decode {s}x{c // 1024}k": [(c, 1)] * s for s in (64, 256, 512) for c in (1024, 8192)}
        return {**work, "mixed": [(512, 1)] * 16 + [(256, 256), (0, 512)], "prefill 4x2k": [(0, 2048)] * 4}
    scale = 8 if quick else 1
    return {f"decode {64 // scale}x{1024 // scale}": [(1024 // scale, 1)] * (64 // scale),
            "mixed": [(512 // scale, 1)] * (16 // scale) + [(256 // scale, 256 // scale), (0, 512 // scale)],
            f"prefill 2x{512 // scale}": [(0, 512 // scale)] * 2}


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
    kp, kq = jax.random.split(jax.random.PRNGKey(seed))  # on the device: an 8k x 512 pool is ~17 GB
    pool = jax.random.normal(kp, (1, 2, num_blocks, block_size, kv_heads, d), dtype)
    q = jax.random.normal(kq, (t, heads, d), dtype)
    kv_bytes = sum(c + n for c, n in seqs) * 2 * kv_heads * d * jnp.dtype(dtype).itemsize
    return (q, pool, jnp.int32(0), jnp.asarray(tables), jnp.asarray(token_seq, jnp.int32),
            jnp.asarray(positions, jnp.int32)), kv_bytes


# (kv_blocks, num_splits, fill_programs) of the Pallas kernel timed by --tune on decode cases; the first is the
# baseline the others are compared with (the defaults, `paged_attention.default_variant`, were the fastest of the
# static ones on an H200; 1 x 4 and 4 x 4 splits, timed then, never won; the fill_programs splits are untimed)
TUNE_CONFIGS = ((1, 1, 0), (4, 1, 0), (8, 1, 0), (8, 8, 0), (4, 8, 2048), (8, 8, 1024), (8, 8, 4096))


def variant_name(kv_blocks: int, num_splits: int, fill_programs: int = 0) -> str:
    """A Triton attention variant's name in --tune's tables: "kv8_split8", "kv8_split8_fill1024"."""
    return f"kv{kv_blocks}_split{num_splits}" + (f"_fill{fill_programs}" if fill_programs else "")


def variant_settings(name: str) -> dict[str, int]:
    """`variant_name`'s inverse: {"kv_blocks", "num_splits", "fill_programs"}."""
    kv, _, rest = name.removeprefix("kv").partition("_split")
    splits, _, fill = rest.partition("_fill")
    return {"kv_blocks": int(kv), "num_splits": int(splits), "fill_programs": int(fill or 0)}
MOSAIC_STAGES = (2, 4)  # the Mosaic GPU decode kernel's steps in flight, timed by --tune on sm90
# (block_m, kv_blocks, num_warps, num_stages) timed by --tune on prefill and mixed cases (0 kv_blocks: the default):
# query rows per tile (16-128 timed on an H200: 64 fastest at long prefills, now the default there), then bigger
# key steps, more warps and deeper pipelines for the tensor cores (untimed)
PREFILL_VARIANTS = ((16, 0, 4, 2), (32, 0, 4, 2), (64, 0, 4, 2), (128, 0, 4, 2), (64, 8, 4, 3), (128, 4, 8, 2),
                    (128, 8, 8, 2), (128, 8, 8, 3))


def prefill_variant_name(block_m: int, kv_blocks: int = 0, num_warps: int = 4, num_stages: int = 2) -> str:
    """"bm64", "bm128_kv8_w8_st3": a prefill variant's name in --tune's tables (defaults left out)."""
    return (f"bm{block_m}" + (f"_kv{kv_blocks}" if kv_blocks else "") + (f"_w{num_warps}" if num_warps != 4 else "")
            + (f"_st{num_stages}" if num_stages != 2 else ""))


def tune_variants(sm: float, interpret: bool, only: tuple[str, ...] | None = None, decode: bool = True) -> dict:
    """name -> jitted attention(q, pool, layer, tables, token_seq, positions) of each variant --tune times.
    Decode: the Triton kernel's `TUNE_CONFIGS` (`variant_name`s) and on an sm90 GPU the
    Mosaic GPU decode kernel (one token per sequence: its length is the token's position + 1); prefill and
    mixed steps: the Triton kernel's `PREFILL_VARIANTS` (query tile sizes, key steps, warps and pipeline
    stages for the tensor cores). only: the names starting with one of these."""
    if not decode:
        variants = {prefill_variant_name(*v): jax.jit(lambda *a, v=v: ragged_paged_attention(
            *a, sm_scale=sm, block_m=v[0], kv_blocks=v[1] or None, num_warps=v[2], num_stages=v[3],
            interpret=interpret)) for v in PREFILL_VARIANTS}
        return {k: v for k, v in variants.items() if only is None or k.startswith(only)}
    variants = {variant_name(kb, ns, fp): jax.jit(lambda *a, kb=kb, ns=ns, fp=fp: ragged_paged_attention(
        *a, sm_scale=sm, kv_blocks=kb, num_splits=ns, fill_programs=fp, interpret=interpret))
        for kb, ns, fp in TUNE_CONFIGS}
    if not interpret and getattr(jax.devices()[0], "compute_capability", "") == "9.0":
        from pallas_kernels.paged_attention_mgpu import decode_paged_attention_mgpu
        for st in MOSAIC_STAGES:
            variants[f"mosaic_st{st}"] = jax.jit(lambda q, pool, layer, tables, seq, pos, st=st: (
                decode_paged_attention_mgpu(q, pool, layer, tables, pos + 1, sm_scale=sm, stages=st)))
    return {k: v for k, v in variants.items() if only is None or k.startswith(only)}


def tune_case(args, sm: float, interpret: bool, iters: int, reference, only: tuple[str, ...] | None = None,
              arg_sets: list[tuple] | None = None, decode: bool = True, kernel_err: float | None = None
              ) -> tuple[dict[str, float], dict]:
    """Kernel ms and max abs error against `reference` (the plain-JAX output) of each `tune_variants` variant
    on one case. A variant that fails to compile is reported (its error as a string) and skipped; one
    further from the reference than twice `kernel_err` (the default kernel's error on the case; without it,
    the smallest variant's) and 4e-3 (one bf16 ulp at |out| < 1: correct kernels differ from the reference by
    rounding alone) is timed but named wrong, and is never the best."""
    times, errors = {}, {}
    for name, f in tune_variants(sm, interpret, only, decode).items():
        try:  # (a variant the compiler rejects, e.g. past shared memory, is reported, not fatal)
            errors[name] = float(jnp.max(jnp.abs(f(*args).astype(jnp.float32) - reference)))
            times[name] = median_ms(f, *args, iters=iters, arg_sets=arg_sets)
        except Exception as e:  # noqa: BLE001
            errors[name] = f"failed: {type(e).__name__}: {str(e)[:3000]}"
            print(f"  {name}: {errors[name]}", flush=True)
    measured = [v for v in errors.values() if isinstance(v, float)]
    allowed = max(2 * (kernel_err if kernel_err is not None else min(measured, default=0.0)), 4e-3)
    for name, err in errors.items():  # (judged after all ran: the first is no more trusted than the others)
        if isinstance(err, float) and not err <= allowed:
            errors[name] = f"wrong: max abs error {err:.2e}, more than {allowed:.2e}"
            print(f"  {name}: {errors[name]}", flush=True)
    return times, errors


def best_triton_variant(rows: list[dict], head_dim: int) -> str | None:
    """The Triton variant (its `variant_name`) with the lowest geometric mean time relative to the
    baseline (`TUNE_CONFIGS[0]`) over the tuned decode rows at head_dim, among those correct on every such row;
    None without such rows."""
    default = variant_name(*TUNE_CONFIGS[0])
    rows = [r for r in rows if r.get("head_dim") == head_dim and default in r.get("variants_ms", {})]
    scores = {}
    for name in (variant_name(*c) for c in TUNE_CONFIGS):
        ratios = [r["variants_ms"][name] / r["variants_ms"][default] for r in rows
                  if isinstance(r["variants_max_abs_err"].get(name), float)
                  and isinstance(r["variants_max_abs_err"].get(default), float)]
        if ratios and len(ratios) == len(rows):
            scores[name] = float(np.exp(np.mean(np.log(ratios))))
    return min(scores, key=scores.get) if scores else None


def bench_attention(quick: bool, iters: int, interpret: bool, dtype, backend: str = "pallas",
                    ceilings: dict | None = None, tune: bool = False, variants: tuple[str, ...] | None = None
                    ) -> Iterator[dict]:
    """Each case's row as it is done. backend "pallas": the Triton kernel (interpreted off GPU); "cpu": the C++
    CPU kernel. ceilings: from `device_ceilings.measure` (adds the % columns). tune (Pallas): each case also
    timing `tune_variants` (row["variants_ms"], row["variants_max_abs_err"], row["best_variant"]), those whose
    names start with one of `variants` where given."""
    def case_row(model: str, h: int, kh: int, d: int, name: str, seqs) -> dict:
        """One case's row: the kernel checked against the reference, both timed (and the variants with tune)."""
        args, kv_bytes = attention_case(seqs, h, kh, d, dtype)
        sets = None  # (a GPU: copies past L2, e.g. SmolLM2's 64 x 1k pool is 50 MB)
        if backend == "pallas" and not interpret and copies_past_cache(args[1].nbytes) > 1:
            sets = [args] + [attention_case(seqs, h, kh, d, dtype, seed=i)[0]
                             for i in range(1, copies_past_cache(args[1].nbytes))]
        sm = d ** -0.5
        if backend == "cpu":
            kern = jax.jit(lambda *a, sm=sm: cpu_attention.ragged_paged_attention_cpu(*a, sm_scale=sm))
        else:
            kern = jax.jit(lambda *a, sm=sm: ragged_paged_attention(*a, sm_scale=sm, interpret=interpret))
        ref = jax.jit(lambda *a, sm=sm: reference_ragged_paged_attention(*a, sm_scale=sm))
        expected = ref(*args).astype(jnp.float32)
        err = float(jnp.max(jnp.abs(kern(*args).astype(jnp.float32) - expected)))
        k_ms = median_ms(kern, *args, iters=iters, arg_sets=sets)
        r_ms = median_ms(ref, *args, iters=iters, budget_s=0.5 if tune else 2.0, arg_sets=sets)
        flops = causal_flops(seqs, h, d)
        row = {"kernel": "paged_attention" if backend == "pallas" else "cpu_attention",
               "case": f"{model} {name}", "head_dim": d, "tokens": int(args[0].shape[0]), "sequences": len(seqs),
               "max_abs_err": err, "kernel_ms": k_ms, "reference_ms": r_ms, "speedup": r_ms / k_ms,
               "kv_bytes": kv_bytes, "kernel_kv_GBps": kv_bytes / k_ms / 1e6,
               "reference_kv_GBps": kv_bytes / r_ms / 1e6, "causal_flops": flops,
               "kernel_TFLOPs": flops / k_ms / 1e9, "reference_TFLOPs": flops / r_ms / 1e9}
        if ceilings:
            row["kernel_pct_of_copy_bw"] = 100 * row["kernel_kv_GBps"] / ceilings["copy_GBps"]
            row["kernel_pct_of_matmul"] = 100 * row["kernel_TFLOPs"] / ceilings["matmul_TFLOPs"]
        if tune:
            row["variants_ms"], row["variants_max_abs_err"] = tune_case(
                args, sm, interpret, iters, expected, variants, sets, decode=name.startswith("decode"),
                kernel_err=err)
            correct = {k: v for k, v in row["variants_ms"].items() if isinstance(row["variants_max_abs_err"][k], float)}
            if correct:
                row["best_variant"] = min(correct, key=correct.get)
                best_ms = row["variants_ms"][row["best_variant"]]
                row["best_kv_GBps"] = kv_bytes / best_ms / 1e6
                if ceilings:
                    row["best_pct_of_copy_bw"] = 100 * row["best_kv_GBps"] / ceilings["copy_GBps"]
        return row

    workloads = attention_workloads(backend == "pallas" and not interpret, quick)
    cases = [(model, shape, name, seqs) for model, shape in MODEL_SHAPES.items() for name, seqs in workloads.items()]
    if tune:  # prefill and mixed, then decodes with the longest contexts first, the two models in turn (a stage
        # cut short keeps both)
        prefill = variants is None or any(prefill_variant_name(*v).startswith(variants) for v in PREFILL_VARIANTS)
        cases = sorted((c for c in cases if prefill or c[2].startswith("decode")),
                       key=lambda c: (c[2].startswith("decode"), -c[3][0][0], len(c[3])))
    for model, (h, kh, d), name, seqs in cases:
        try:  # (a case that fails to compile or run is reported; the others still run)
            row = case_row(model, h, kh, d, name, seqs)
        except Exception as e:  # noqa: BLE001
            print(f"{model} {name}: failed: {type(e).__name__}: {str(e)[:2000]}", flush=True)
            continue
        yield row


# (tile, num_warps, row_splits) of the sampler timed by --tune, the default first: one program per row walks its
# logits in tile-wide steps, per-lane sums and no reduction inside a pass (on an H200, 2026-12-04, 4,096 lanes with
# 16 warps were the fastest or within 10% of it in 7 of 10 cases; 8,192 lanes or 1,024 / 4 up to 19% faster
# without a filter or with top-k alone); row_splits: the first pass split over 2-4 programs a row (untimed)
SAMPLER_TUNE = ((4096, 16, 1), (4096, 8, 1), (8192, 16, 1), (4096, 16, 2), (4096, 16, 4), (2048, 16, 4))


def sampler_variant_name(tile: int, num_warps: int, row_splits: int = 1) -> str:
    """"tile4096_w16", "tile4096_w16_r4": a sampler variant's name in --tune's tables."""
    return f"tile{tile}_w{num_warps}" + (f"_r{row_splits}" if row_splits > 1 else "")


def bench_sampling(quick: bool, iters: int, interpret: bool, ceilings: dict | None = None,
                   tune: bool = False) -> Iterator[dict]:
    """64 rows (quick: 8) of 49k and 128k logits; the logits' bytes per second against the copy bandwidth.
    tune: each case also timing the `SAMPLER_TUNE` variants (`sampler_variant_name`), each checked to draw
    nothing outside the kept set (row["variants_ms"], row["variants_outside"], row["best_variant"])."""
    batch = 8 if quick else 64
    for vocab in (49_152, 128_256):
        logits = jax.random.normal(jax.random.PRNGKey(vocab), (batch, vocab), jnp.float32) * 3
        keys = jax.random.split(jax.random.PRNGKey(1), batch)
        others = [jax.random.normal(jax.random.PRNGKey(vocab + i), (batch, vocab), jnp.float32) * 3
                  for i in range(1, 1 if interpret else copies_past_cache(logits.nbytes))]  # (GPU: past L2)
        for name, k, p in (("top-k 50 + top-p 0.9", 50, 0.9), ("top-p 0.9", 0, 0.9), ("top-k 50", 50, 1.0)):
            temp, top_k, top_p = jnp.full(batch, 0.8), jnp.full(batch, k, jnp.int32), jnp.full(batch, p)
            kern = jax.jit(lambda *a: top_k_top_p_sampling(*a, interpret=interpret))
            ref = jax.jit(reference_top_k_top_p_sampling)
            kept = top_k_top_p_mask(logits / 0.8, top_k, top_p) > -jnp.inf

            def outside(f, args=(logits, keys, temp, top_k, top_p), kept=kept):  # draws outside the kept set
                tok = f(*args)
                return int(jnp.sum(~jnp.take_along_axis(kept, tok[:, None], axis=1)))

            sets = [(x, keys, temp, top_k, top_p) for x in [logits, *others]]
            k_ms = median_ms(kern, *sets[0], iters=iters, arg_sets=sets)
            r_ms = median_ms(ref, *sets[0], iters=iters, arg_sets=sets)
            row = {"kernel": "sampling", "case": f"V={vocab} {name}", "tokens": batch,
                   "draws_outside_kept_set": outside(kern), "kernel_ms": k_ms, "reference_ms": r_ms,
                   "speedup": r_ms / k_ms, "kernel_tokens_per_s": batch / k_ms * 1e3,
                   "reference_tokens_per_s": batch / r_ms * 1e3, "kernel_logits_GBps": logits.nbytes / k_ms / 1e6}
            if ceilings:
                row["kernel_pct_of_copy_bw"] = 100 * row["kernel_logits_GBps"] / ceilings["copy_GBps"]
            if tune:
                row["variants_ms"], row["variants_outside"] = {}, {}
                for tile, warps, splits in SAMPLER_TUNE:
                    variant = sampler_variant_name(tile, warps, splits)
                    f = jax.jit(lambda *a, t=tile, w=warps, r=splits: top_k_top_p_sampling(
                        *a, tile=t, num_warps=w, row_splits=r, interpret=interpret))
                    try:  # (one the compiler rejects is reported, not fatal)
                        row["variants_outside"][variant] = outside(f)
                        row["variants_ms"][variant] = median_ms(f, *sets[0], iters=iters, arg_sets=sets)
                    except Exception as e:  # noqa: BLE001
                        row["variants_outside"][variant] = f"failed: {type(e).__name__}: {str(e)[:2000]}"
                        print(f"  {variant}: {row['variants_outside'][variant]}", flush=True)
                correct = {v: ms for v, ms in row["variants_ms"].items() if row["variants_outside"][v] == 0}
                if correct:
                    row["best_variant"] = min(correct, key=correct.get)
                    row["best_logits_GBps"] = logits.nbytes / correct[row["best_variant"]] / 1e6
            yield row


# SmolLM2-135M's matmuls per layer, (K, N): q/k/v fused, o, gate/up fused, down
DENSE_SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))


def bench_dense(quick: bool, iters: int, ceilings: dict | None = None) -> Iterator[dict]:
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
    for m in (8, 64) if quick else (8, 16, 32, 64, 128, 256, 512):
        x = jnp.asarray(rng.standard_normal((m, DENSE_SHAPES[0][0]), np.float32))
        err = max(float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))) for a, b in zip(kern(x, packed), ref(x, plain)))
        k_ms, r_ms = median_ms(kern, x, packed, iters=iters), median_ms(ref, x, plain, iters=iters)
        row = {"kernel": "cpu_dense", "case": f"smollm2 x{layers} layers, {m} rows", "tokens": m,
               "max_rel_err": err, "kernel_ms": k_ms, "reference_ms": r_ms, "speedup": r_ms / k_ms,
               "kernel_GFLOPs": flops_per_row * m / k_ms / 1e6, "reference_GFLOPs": flops_per_row * m / r_ms / 1e6}
        if ceilings:
            row["kernel_pct_of_matmul"] = 100 * row["kernel_GFLOPs"] / 1e3 / ceilings["matmul_TFLOPs"]
        yield row


def row_line(r: dict) -> str:
    """One row of the table: kernel, case, check, times, speedup, throughput (and its share of the ceilings)."""
    pct = lambda key, what: f" = {r[key]:.1f}% of {what}" if key in r else ""  # noqa: E731
    if r["kernel"] in ("paged_attention", "cpu_attention"):
        check = f"{r['max_abs_err']:.1e}"
        tput = (f"{r['kernel_kv_GBps']:.1f} GB/s K/V{pct('kernel_pct_of_copy_bw', 'copy')}, "
                f"{r['kernel_TFLOPs']:.3g} TFLOP/s{pct('kernel_pct_of_matmul', 'matmul')} "
                f"(ref {r['reference_kv_GBps']:.1f} GB/s)")
    elif r["kernel"] == "cpu_dense":
        check = f"{r['max_rel_err']:.1e} rel"
        tput = (f"{r['kernel_GFLOPs']:.0f} GFLOP/s{pct('kernel_pct_of_matmul', 'matmul')} "
                f"(ref {r['reference_GFLOPs']:.0f}: XLA's dot)")
    else:
        check = f"{r['draws_outside_kept_set']} outside"
        tput = (f"{r['kernel_tokens_per_s']:,.0f} tok/s, {r['kernel_logits_GBps']:.1f} GB/s of logits"
                f"{pct('kernel_pct_of_copy_bw', 'copy')} (ref {r['reference_tokens_per_s']:,.0f} tok/s)")
    line = (f"{r['kernel']:<16}{r['case']:<32}{check:>12}{r['kernel_ms']:>11.3f}{r['reference_ms']:>10.3f}"
            f"{r['speedup']:>8.2f}x  {tput}")
    if "best_variant" in r:
        rate = (f"{r['best_kv_GBps']:.1f} GB/s{pct('best_pct_of_copy_bw', 'copy')}" if "best_kv_GBps" in r
                else f"{r['best_logits_GBps']:.1f} GB/s of logits")
        line += ("\n" + " " * 18 + "tuned: " + ", ".join(f"{k} {v:.3f}" for k, v in r["variants_ms"].items())
                 + f"; best {r['best_variant']}: {rate}")
    return line


def print_table(rows: list[dict], device: str, ceilings: dict | None = None) -> None:
    print(f"\nKernels vs references on {device}")
    if ceilings:
        print(f"Ceilings measured in this run: copy {ceilings['copy_GBps']:,.0f} GB/s (read + write, "
              f"{ceilings['copy_bytes'] >> 20} MiB), matmul {ceilings['matmul_TFLOPs']:.3g} TFLOP/s "
              f"({ceilings['matmul_n']}^3 {ceilings['dtype']})")
    print(f"{'kernel':<16}{'case':<32}{'check':>12}{'kernel ms':>11}{'ref ms':>10}{'speedup':>9}  throughput")
    for r in rows:
        print(row_line(r))


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="small shapes (default off GPU: kernels are interpreted)")
    p.add_argument("--iters", type=int, default=None, help="timed runs per case (default 20 on GPU, 2 off)")
    p.add_argument("--only", choices=("attention", "sampling", "dense"), default=None,
                   help="one kernel (dense: the CPU dense call, on a CPU that builds it)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default=None,
                   help="q and KV pool dtype (default: bfloat16 on GPU, float32 off GPU)")
    p.add_argument("--tune", action="store_true",
                   help="also time the Pallas kernel's kv_blocks / num_splits variants on each decode case (and, on "
                        "sm90, the Mosaic GPU decode kernel), its query tile sizes on prefill and mixed cases, and "
                        "the sampler's tile / num_warps variants")
    p.add_argument("--tune-variants", default=None,
                   help="with --tune: only the variants whose names start with one of these (comma-separated), "
                        "e.g. kv1_split1,mosaic")
    p.add_argument("--no-ceilings", action="store_true",
                   help="skip measuring the device's copy bandwidth and matmul rate (no %% columns)")
    p.add_argument("--output-json", default="bench_results/kernels.json")


def main(ns: argparse.Namespace) -> list[dict]:
    gpu = platform_is_gpu()
    interpret = not gpu
    quick = ns.quick or not gpu
    # the C++ attention off GPU (full shapes unless --quick); --tune times the Pallas kernel's variants instead
    cpu_kernel = jax.default_backend() == "cpu" and cpu_attention.available() and not ns.tune
    iters = ns.iters or (20 if gpu else 2)
    device = jax.devices()[0].device_kind + (" (Triton)" if gpu else " (attention: the C++ CPU kernel; sampling: "
                                             "Pallas interpreter, times are not kernel speed)" if cpu_kernel
                                             else " (Pallas interpreter: times are not kernel speed)")
    dtype = jnp.dtype(ns.dtype or ("bfloat16" if gpu else "float32"))
    ceilings = None if ns.no_ceilings else device_ceilings.measure(gpu, ns.quick, dtype)
    kernels = []  # each a generator of rows, made when its turn comes
    if ns.only in (None, "attention"):
        kernels.append(lambda: bench_attention(ns.quick if cpu_kernel else quick,
                                               ns.iters or (10 if cpu_kernel else iters), interpret, dtype,
                                               "cpu" if cpu_kernel else "pallas", ceilings, ns.tune,
                                               tuple(ns.tune_variants.split(",")) if ns.tune_variants else None))
    if ns.only in (None, "sampling"):
        kernels.append(lambda: bench_sampling(quick, iters, interpret, ceilings, ns.tune))
    if ns.only in (None, "dense") and jax.default_backend() == "cpu" and cpu_dense.panel():
        kernels.append(lambda: bench_dense(ns.quick, ns.iters or 10, ceilings))
    rows = []
    for row in (row for kernel in kernels for row in kernel()):  # print and save each as it comes: a run cut
        print(row_line(row), flush=True)                         # short keeps what it measured
        rows.append(row)
        if ns.output_json:
            os.makedirs(os.path.dirname(ns.output_json) or ".", exist_ok=True)
            with open(ns.output_json, "w") as f:
                json.dump({"device": device, "dtype": jnp.dtype(dtype).name, "quick": quick,
                           "attention_quick": ns.quick if cpu_kernel else quick, "ceilings": ceilings,
                           "rows": rows}, f, indent=2)
    print_table(rows, device, ceilings)
    return rows


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_args(parser)
    main(parser.parse_args())

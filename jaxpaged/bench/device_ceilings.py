"""The device's two ceilings, measured in the run that reports against them: copy bandwidth and a matmul's rate.

A kernel's throughput means little alone; `jaxpaged bench kernels` reports memory-bound kernels (decode attention)
as a share of the bandwidth a plain device-to-device copy reaches and compute-bound ones (prefill attention) as a
share of a large matmul's rate, both measured here rather than taken from a datasheet. (On a CPU the copy is
XLA's elementwise loop and a benchmark's KV pool may fit the last-level cache, so decode can read faster than
"100%" of it; the ceilings are meant for GPUs, where both are far past the caches.)
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np


def median_ms(fn, *args, iters: int, budget_s: float = 2.0, arg_sets: list[tuple] | None = None,
              sample_ms: float = 2.0, max_reps: int = 64) -> float:
    """Median time of one fn call in ms, after a warm-up (compile) call on each argument set. Each of `iters`
    samples (fewer, at least 3, where they would take longer than budget_s) dispatches `reps` calls back to
    back, as a jitted step runs its kernels, and waits for the last: no host round trip in the time of a
    short kernel. reps makes a sample last about sample_ms (from one synchronized call; at most max_reps).
    arg_sets: argument tuples the calls cycle through instead of args (inputs larger together than the
    device's caches, so that a small case is timed from memory, not from L2)."""
    sets = arg_sets or [args]
    for a in sets:
        jax.block_until_ready(fn(*a))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*sets[0]))
    reps = max(1, min(max_reps, int(sample_ms / 1e3 / max(time.perf_counter() - t0, 1e-7))))
    times, spent, calls = [], 0.0, 0
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(reps):
            out = fn(*sets[calls % len(sets)])
            calls += 1
        jax.block_until_ready(out)
        elapsed = time.perf_counter() - t0
        times.append(elapsed / reps)
        spent += elapsed
        if len(times) >= 3 and spent > budget_s:
            break
    return 1e3 * float(np.median(times))


def copy_bandwidth_GBps(nbytes: int, dtype=jnp.bfloat16, iters: int = 10) -> float:
    """Bytes read plus bytes written per second by a jitted elementwise copy (x + 1) of an nbytes buffer, the
    faster of dtype and float32 (on an H200, 2026-12-04, bf16 `x + 1` timed call by call gave 2.76 TB/s where
    PyTorch's copy reaches ~4.3)."""
    best = 0.0
    for dt in dict.fromkeys((jnp.dtype(dtype), jnp.dtype(jnp.float32))):
        x = jnp.ones((nbytes // dt.itemsize,), dt)
        ms = median_ms(jax.jit(lambda a, dt=dt: a + jnp.asarray(1, dt)), x, iters=iters)
        best = max(best, 2 * x.nbytes / ms / 1e6)
        del x
    return best


def matmul_TFLOPs(n: int, dtype=jnp.bfloat16, iters: int = 10) -> float:
    """2 n^3 per second of a jitted [n, n] @ [n, n] on random data in dtype (float32 accumulation)."""
    ka, kb = jax.random.split(jax.random.PRNGKey(0))
    a, b = jax.random.normal(ka, (n, n), dtype), jax.random.normal(kb, (n, n), dtype)
    ms = median_ms(jax.jit(lambda p, q: jnp.matmul(p, q, preferred_element_type=jnp.float32)), a, b, iters=iters)
    return 2 * n ** 3 / ms / 1e9


def measure(gpu: bool, quick: bool, dtype) -> dict:
    """Both ceilings at sizes well past the caches (GPU: a 2 GiB copy, an 8192^3 matmul; CPU: 256 MiB, 1024^3;
    quick: small, a smoke check only)."""
    copy_bytes, n = (2 << 30, 8192) if gpu and not quick else (256 << 20, 1024) if not quick else (16 << 20, 256)
    return {"copy_GBps": copy_bandwidth_GBps(copy_bytes, dtype), "copy_bytes": copy_bytes,
            "matmul_TFLOPs": matmul_TFLOPs(n, dtype), "matmul_n": n, "dtype": jnp.dtype(dtype).name}

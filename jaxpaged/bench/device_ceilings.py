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


def median_ms(fn, *args, iters: int, budget_s: float = 2.0) -> float:
    """Median wall time of fn(*args) in ms over `iters` runs after one warm-up (compile) run, fewer (at least
    3) where they would take longer than budget_s (a slow reference at the largest shapes)."""
    jax.block_until_ready(fn(*args))
    times, spent = [], 0.0
    for _ in range(iters):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
        spent += times[-1]
        if len(times) >= 3 and spent > budget_s:
            break
    return 1e3 * float(np.median(times))


def copy_bandwidth_GBps(nbytes: int, dtype=jnp.bfloat16, iters: int = 10) -> float:
    """Bytes read plus bytes written per second by a jitted elementwise copy (x + 1) of an nbytes buffer."""
    x = jnp.ones((nbytes // jnp.dtype(dtype).itemsize,), dtype)
    ms = median_ms(jax.jit(lambda a: a + jnp.asarray(1, dtype)), x, iters=iters)
    return 2 * x.nbytes / ms / 1e6


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

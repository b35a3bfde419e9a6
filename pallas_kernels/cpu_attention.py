"""Ragged paged attention on CPUs: the C++ kernel in `cpu/ragged_paged_attention.cc` as a JAX function.

Same meaning and arguments as `pallas_kernels.paged_attention.ragged_paged_attention` (each token over keys
0..positions[t] of its sequence, new tokens' K/V already written to the pool), tested equal to
`reference_ragged_paged_attention`. It reads each key of a query tile once, widening bf16/f16/fp8 pools as it
goes, and runs on XLA's intra-op threads. `available()` says whether the kernel could be built here.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

from pallas_kernels import cpu_build
from pallas_kernels.paged_attention import check_paged_attention_args

TARGET = "jaxpaged_ragged_paged_attention"


@functools.cache
def available() -> bool:
    """True once the kernel is built and registered with XLA for the CPU platform."""
    return cpu_build.register("ragged_paged_attention", "JaxpagedRaggedPagedAttention", TARGET)


def ragged_paged_attention_cpu(
    q: Float[Array, "T H D"],
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "S B"],
    token_seq: Int[Array, "T"],
    positions: Int[Array, "T"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> Float[Array, "T H D"]:
    """Attention of each token over its sequence's keys 0..positions[t], in float32, returned in q's dtype;
    softcap: scores squashed to softcap * tanh(score / softcap) first (Gemma 2)."""
    check_paged_attention_args(q, kv_pool, block_tables, token_seq, positions)
    if not available():
        raise RuntimeError("the CPU attention kernel could not be built on this machine (see the log)")
    call = jax.ffi.ffi_call(TARGET, jax.ShapeDtypeStruct(q.shape, jnp.float32))
    out = call(q.astype(jnp.float32), kv_pool, jnp.asarray(layer, jnp.int32).reshape(()),
               block_tables.astype(jnp.int32), token_seq.astype(jnp.int32), positions.astype(jnp.int32),
               sm_scale=np.float32(sm_scale), sliding_window=np.int64(sliding_window or 0),
               softcap=np.float32(softcap or 0))
    return out.astype(q.dtype)

"""KV writes and paged attention as the model calls them; picks the implementation per backend."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from functools import partial

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from jaxpaged.layers.attention_xla import split_ragged_paged_attention
from pallas_kernels.cpu_attention import ragged_paged_attention_cpu
from pallas_kernels.kv_storage import encode, storage_dtype
from pallas_kernels.paged_attention import ragged_paged_attention


def write_kv(
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    k: Float[Array, "T KH D"],
    v: Float[Array, "T KH D"],
    slot_mapping: Int[Array, "T"],
) -> Float[Array, "L 2 N bs KH D"]:
    """Scatter new K/V into their slots (block * block_size + offset). Out-of-range slots (padding) are dropped.

    The pool may hold a narrower dtype than k and v (bfloat16, float16 or fp8 KV, stored as integers: see
    `pallas_kernels.kv_storage`): values are rounded to it, saturating at its largest finite value.
    """
    block_size = kv_pool.shape[3]
    blk, off = slot_mapping // block_size, slot_mapping % block_size
    kv_pool = kv_pool.at[layer, 0, blk, off].set(encode(k, kv_pool.dtype), mode="drop")
    return kv_pool.at[layer, 1, blk, off].set(encode(v, kv_pool.dtype), mode="drop")


def paged_attention(
    q: Float[Array, "T H D"],
    k_new: Float[Array, "T KH D"],
    v_new: Float[Array, "T KH D"],
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "S B"],
    token_seq: Int[Array, "T"],
    positions: Int[Array, "T"],
    decode_context_lens: Int[Array, "T"],
    seq_context_lens: Int[Array, "S"],
    continuation_rows: Int[Array, "S"],
    *,
    sm_scale: float,
    sliding_window: int | None,
    kv_chunk: int,
    backend: str = "reference",
    max_query_len: int | None = None,
    softcap: float | None = None,
) -> Float[Array, "T H D"]:
    """Each token over its sequence's cached context (in the pool) and the step's new tokens, causally.

    backend "reference": the plain-JAX `split_ragged_paged_attention`, which expects decode tokens in
    the first rows, longest context first (the runner lays steps out that way); tests hold it equal to
    `pallas_kernels.paged_attention.reference_ragged_paged_attention`. "pallas": the Triton kernel,
    reading the new tokens' K/V from the pool (written just before); "pallas-interpret": the same
    kernel through the Pallas interpreter (CPU tests); "cpu": the C++ kernel for CPUs, reading the pool
    as the Pallas kernel does. `max_query_len` (static, optional): no sequence
    has more new tokens than this; the reference path then reads fewer new keys per token. softcap: scores
    squashed to softcap * tanh(score / softcap) (Gemma 2), on every backend.
    """
    if backend in ("pallas", "pallas-interpret"):
        return ragged_paged_attention(q, kv_pool, layer, block_tables, token_seq, positions, sm_scale=sm_scale,
                                      sliding_window=sliding_window, softcap=softcap,
                                      interpret=backend == "pallas-interpret")
    if backend == "cpu":
        return ragged_paged_attention_cpu(q, kv_pool, layer, block_tables, token_seq, positions, sm_scale=sm_scale,
                                          sliding_window=sliding_window, softcap=softcap)
    if backend != "reference":
        raise ValueError(f"attention backend {backend!r} is not one of reference, pallas, pallas-interpret, cpu")
    return split_ragged_paged_attention(
        q, k_new, v_new, kv_pool, layer, block_tables, token_seq, positions, decode_context_lens,
        seq_context_lens, continuation_rows, sm_scale=sm_scale, sliding_window=sliding_window, kv_chunk=kv_chunk,
        max_query_len=max_query_len, softcap=softcap,
    )


def kv_pool_spec(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype,
                 sharding=None) -> jax.ShapeDtypeStruct:
    """The shape, storage dtype and sharding `empty_kv_pool` gives (to compile against before it exists)."""
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    return jax.ShapeDtypeStruct(shape, storage_dtype(dtype), sharding=sharding)


def empty_kv_pool_soon(*args, sharding=None) -> Future:
    """`empty_kv_pool(*args)` made on a thread: zeroing a large pool takes seconds of page faults on a CPU,
    which can overlap loading weights and compiling."""
    zeroing = ThreadPoolExecutor(1, thread_name_prefix="kv-pool")
    try:
        return zeroing.submit(empty_kv_pool, *args, sharding=sharding)
    finally:
        zeroing.shutdown(wait=False)


def empty_kv_pool(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int, dtype,
                  sharding=None):
    """A zeroed pool [L, 2, N, block_size, KH, D] of KV values of `dtype` (in its storage dtype); with a
    `sharding`, made in place on its devices (tensor parallelism: each holds its KV heads)."""
    shape, dtype = (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), storage_dtype(dtype)
    if sharding is None:
        return jnp.zeros(shape, dtype)
    return jax.jit(partial(jnp.zeros, shape, dtype), out_shardings=sharding)()

"""Ragged paged attention: each token attends to its sequence's context in a paged KV pool.

The pool holds every layer: kv_pool[layer, 0] is K and kv_pool[layer, 1] is V, each
[num_blocks, block_size, num_kv_heads, head_dim]. A token's sequence is `token_seq[t]`, whose
context is read through `block_tables[token_seq[t]]`; it sees keys at positions <= positions[t]
(causal within new tokens, the whole cached prefix before them).

This file holds the plain-JAX reference. It never copies a layer of the pool: it gathers only
the blocks it reads, a chunk of context at a time, with an online softmax, and stops after the
longest context in the batch (a dynamic trip count, so context length needs no shape bucket).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int


_MASKED = -1e30


def check_paged_attention_args(q, kv_pool, block_tables, token_seq, positions, kv_chunk: int) -> None:
    """Raise ValueError on shapes or dtypes the attention cannot take."""
    if q.ndim != 3:
        raise ValueError(f"q must be [T, H, D], got shape {q.shape}")
    if kv_pool.ndim != 6 or kv_pool.shape[1] != 2:
        raise ValueError(f"kv_pool must be [L, 2, N, block_size, KH, D], got shape {kv_pool.shape}")
    t, h, d = q.shape
    _, _, _, block_size, kh, dk = kv_pool.shape
    if dk != d:
        raise ValueError(f"head_dim mismatch: q has {d}, kv_pool has {dk}")
    if h % kh:
        raise ValueError(f"query heads ({h}) must be a multiple of KV heads ({kh})")
    if q.dtype != kv_pool.dtype:
        raise ValueError(f"dtype mismatch: q is {q.dtype}, kv_pool is {kv_pool.dtype}")
    if token_seq.shape != (t,) or positions.shape != (t,):
        raise ValueError(f"token_seq and positions must be [T={t}], got {token_seq.shape}, {positions.shape}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, B], got shape {block_tables.shape}")
    if kv_chunk % block_size or (block_tables.shape[1] * block_size) % kv_chunk:
        raise ValueError(
            f"kv_chunk ({kv_chunk}) must be a multiple of block_size ({block_size}) and divide the table "
            f"span ({block_tables.shape[1]} blocks)"
        )


def reference_ragged_paged_attention(
    q: Float[Array, "T H D"],
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "S B"],
    token_seq: Int[Array, "T"],
    positions: Int[Array, "T"],
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    kv_chunk: int = 128,
) -> Float[Array, "T H D"]:
    """Attention of each token over keys [0, positions[t]] of sequence token_seq[t], float32 softmax."""
    check_paged_attention_args(q, kv_pool, block_tables, token_seq, positions, kv_chunk)
    t, h, d = q.shape
    block_size, kh = kv_pool.shape[3], kv_pool.shape[4]
    group = h // kh
    blocks_per_chunk = kv_chunk // block_size
    qg = q.reshape(t, kh, group, d).astype(jnp.float32) * sm_scale
    tables = block_tables[token_seq]  # [T, B]
    num_chunks = (jnp.max(positions) + kv_chunk) // kv_chunk  # chunks that hold the longest context

    def body(c, carry):
        m, l, acc = carry  # [T, KH, G], [T, KH, G], [T, KH, G, D]
        ids = jax.lax.dynamic_slice_in_dim(tables, c * blocks_per_chunk, blocks_per_chunk, axis=1)
        k = kv_pool[layer, 0, ids].reshape(t, kv_chunk, kh, d).astype(jnp.float32)  # [T, C, KH, D]
        v = kv_pool[layer, 1, ids].reshape(t, kv_chunk, kh, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k)  # [T, KH, G, C]
        key_pos = c * kv_chunk + jnp.arange(kv_chunk)
        visible = key_pos[None, :] <= positions[:, None]  # [T, C]
        if sliding_window is not None:
            visible &= key_pos[None, :] > positions[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, -jnp.inf)
        m_new = jnp.maximum(m, s.max(-1))
        p = jnp.exp(s - m_new[..., None])
        corr = jnp.exp(m - m_new)
        l = l * corr + p.sum(-1)
        acc = acc * corr[..., None] + jnp.einsum("tkgc,tckd->tkgd", p, v)
        return m_new, l, acc

    init = (
        jnp.full((t, kh, group), _MASKED, jnp.float32),  # finite, so a fully masked chunk gives no NaN
        jnp.zeros((t, kh, group), jnp.float32),
        jnp.zeros((t, kh, group, d), jnp.float32),
    )
    if sliding_window is None:
        start = 0
    else:  # skip chunks wholly outside every token's window
        start = jnp.maximum(jnp.min(positions) - sliding_window + 1, 0) // kv_chunk
    _, l, acc = jax.lax.fori_loop(start, num_chunks, body, init)
    return (acc / l[..., None]).reshape(t, h, d).astype(q.dtype)

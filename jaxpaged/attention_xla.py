"""Ragged paged attention in plain XLA, arranged for CPUs (and any backend without the Pallas kernel).

Exact attention over a token's keys split in two parts, merged with their softmax statistics:
  A. the step's own new tokens (same sequence, causal): one dense [T, T] masked product, no gather;
  B. the cached context in the pool (positions < the sequence's first new token): gathered per
     token, a chunk of blocks at a time, only for the first R rows, where the runner puts every
     token that has context (decode tokens, then chunk continuations). If context tokens spill
     past R, a second branch covers all T rows (correct, slower).
A fresh prefill thus costs no gather at all, and a decode token reads exactly its own blocks.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

_MASKED = -1e30


def _merge(a, b):
    """Combine two partial softmax states (m, l, acc) over disjoint key sets."""
    (ma, la, acca), (mb, lb, accb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, acca * ca[..., None] + accb * cb[..., None]


def _new_token_part(qg, k_new, v_new, token_seq, positions, sliding_window):
    """Part A: each token over the step's new tokens of its own sequence, causally."""
    s = jnp.einsum("tkgd,jkd->tkgj", qg, k_new.astype(jnp.float32))  # [T, KH, G, T]
    same = (token_seq[:, None] == token_seq[None, :]) & (token_seq[None, :] >= 0)
    visible = same & (positions[None, :] <= positions[:, None])
    if sliding_window is not None:
        visible &= positions[None, :] > positions[:, None] - sliding_window
    s = jnp.where(visible[:, None, None, :], s, _MASKED)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None])
    return m, p.sum(-1), jnp.einsum("tkgj,jkd->tkgd", p, v_new.astype(jnp.float32))


def _context_part(qg, kv_pool, layer, tables, context_lens, positions, kv_chunk, sliding_window):
    """Part B: each row over its sequence's cached keys [0, context_lens[t]) in the pool."""
    r, kh, group, d = qg.shape
    block_size = kv_pool.shape[3]
    blocks_per_chunk = kv_chunk // block_size
    num_chunks = (jnp.max(context_lens) + kv_chunk - 1) // kv_chunk

    def body(c, carry):
        ids = jax.lax.dynamic_slice_in_dim(tables, c * blocks_per_chunk, blocks_per_chunk, axis=1)
        k = kv_pool[layer, 0, ids].reshape(r, kv_chunk, kh, d).astype(jnp.float32)  # [R, C, KH, D]
        v = kv_pool[layer, 1, ids].reshape(r, kv_chunk, kh, d).astype(jnp.float32)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k)
        key_pos = c * kv_chunk + jnp.arange(kv_chunk)
        visible = key_pos[None, :] < context_lens[:, None]
        if sliding_window is not None:
            visible &= key_pos[None, :] > positions[:, None] - sliding_window
        s = jnp.where(visible[:, None, None, :], s, _MASKED)
        m_c = s.max(-1)
        p = jnp.exp(s - m_c[..., None]) * visible[:, None, None, :]
        return _merge(carry, (m_c, p.sum(-1), jnp.einsum("tkgc,tckd->tkgd", p, v)))

    init = (jnp.full((r, kh, group), _MASKED, jnp.float32), jnp.zeros((r, kh, group), jnp.float32),
            jnp.zeros((r, kh, group, d), jnp.float32))
    return jax.lax.fori_loop(0, num_chunks, body, init)


def split_ragged_paged_attention(
    q: Float[Array, "T H D"],
    k_new: Float[Array, "T KH D"],
    v_new: Float[Array, "T KH D"],
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "S B"],
    token_seq: Int[Array, "T"],  # row of block_tables; -1 for padding tokens
    positions: Int[Array, "T"],
    context_lens: Int[Array, "T"],  # cached tokens of the token's sequence before this step
    *,
    sm_scale: float,
    context_rows: int,
    sliding_window: int | None = None,
    kv_chunk: int = 128,
) -> Float[Array, "T H D"]:
    """Attention of each token over its sequence's cached context and the step's new tokens."""
    t, h, d = q.shape
    kh = k_new.shape[1]
    qg = q.reshape(t, kh, h // kh, d).astype(jnp.float32) * sm_scale
    state = _new_token_part(qg, k_new, v_new, token_seq, positions, sliding_window)
    tables = block_tables[jnp.maximum(token_seq, 0)]  # [T, B]
    r = min(context_rows, t)

    def rows_prefix(state):
        ctx = _context_part(qg[:r], kv_pool, layer, tables[:r], context_lens[:r], positions[:r], kv_chunk,
                            sliding_window)
        head = _merge(tuple(x[:r] for x in state), ctx)
        return tuple(jnp.concatenate([hx, x[r:]]) for hx, x in zip(head, state))

    def all_rows(state):
        return _merge(state, _context_part(qg, kv_pool, layer, tables, context_lens, positions, kv_chunk,
                                           sliding_window))

    spill = jnp.any(context_lens[r:] > 0) if r < t else jnp.bool_(False)
    m, l, acc = jax.lax.cond(spill, all_rows, rows_prefix, state)
    return (acc / l[..., None]).reshape(t, h, d).astype(q.dtype)

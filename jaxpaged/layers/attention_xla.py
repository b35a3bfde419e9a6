"""Ragged paged attention in plain XLA, arranged for CPUs (and any backend without the Pallas kernel).

Exact attention over a token's keys, split in three parts merged with their softmax statistics:
  A. the step's new tokens (same sequence, causal): one dense [T, T] masked product, no gather;
  B. decode tokens' cached context: gathered per token, a chunk of blocks at a time. The runner puts
     decode tokens in the first rows, longest context first, and rows run in groups, each group only
     as far as its own longest context;
  C. chunk continuations' cached context (a prompt split over steps, or a prefix-cache hit): one
     sequence at a time, its context gathered once and shared by all its new tokens.
A fresh prefill thus gathers nothing, and a decode token reads about its own blocks only.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_storage import decode, encode

_MASKED = -1e30
ROW_GROUP = 16  # decode rows per group in part B, at least (16: ~10% faster decode steps than 8 on 2 CPU cores)
MAX_ROW_GROUPS = 8  # and at most this many groups: 256 rows in groups of 32 (9% faster than 16 on a tiny model)


def _merge(a, b):
    """Combine two partial softmax states (m, l, acc) over disjoint key sets."""
    (ma, la, acca), (mb, lb, accb) = a, b
    m = jnp.maximum(ma, mb)
    ca, cb = jnp.exp(ma - m), jnp.exp(mb - m)
    return m, la * ca + lb * cb, acca * ca[..., None] + accb * cb[..., None]


def _empty_state(rows: int, kh: int, group: int, d: int):
    return (jnp.full((rows, kh, group), _MASKED, jnp.float32), jnp.zeros((rows, kh, group), jnp.float32),
            jnp.zeros((rows, kh, group, d), jnp.float32))


def _masked_softmax_part(s, visible, v, pv_spec: str, softcap: float | None = None):
    """(m, l, acc) of scores `s` [.., KH, G, C] over visible keys, with values contracted by `pv_spec`; softcap:
    scores first squashed to softcap * tanh(s / softcap) (Gemma 2)."""
    if softcap:
        s = softcap * jnp.tanh(s / softcap)
    s = jnp.where(visible, s, _MASKED)
    m = s.max(-1)
    p = jnp.exp(s - m[..., None]) * visible
    return m, p.sum(-1), jnp.einsum(pv_spec, p, v)


def _new_token_part(qg, k_new, v_new, token_seq, positions, sliding_window, *, tile: int = 128,
                    max_query_len: int | None = None, softcap: float | None = None):
    """Part A: each token over the step's new tokens of its own sequence, causally.

    A sequence's new tokens are contiguous and in position order, so a token only sees tokens at or
    before it in the flat layout: query tile i reads keys [0, end of tile i) only (the lower triangle).
    With `max_query_len` (no sequence has more new tokens than that), tile i reads only the
    `max_query_len - 1` keys before it as well: a batch of B prompts of P tokens costs B·P·(tile + P)
    instead of (B·P)²/2.
    """
    t = qg.shape[0]
    k_new, v_new = k_new.astype(jnp.float32), v_new.astype(jnp.float32)
    parts = []
    for start in range(0, t, tile):
        end = min(start + tile, t)
        lo = 0 if max_query_len is None else max(0, start - max_query_len + 1)
        s = jnp.einsum("tkgd,jkd->tkgj", qg[start:end], k_new[lo:end])  # [tile, KH, G, end - lo]
        qs, ks = token_seq[start:end], token_seq[lo:end]
        visible = (qs[:, None] == ks[None, :]) & (ks[None, :] >= 0)
        visible &= positions[None, lo:end] <= positions[start:end, None]
        if sliding_window is not None:
            visible &= positions[None, lo:end] > positions[start:end, None] - sliding_window
        parts.append(_masked_softmax_part(s, visible[:, None, None, :], v_new[lo:end], "tkgj,jkd->tkgd", softcap))
    return tuple(jnp.concatenate(xs) for xs in zip(*parts))


def _window_mask(key_pos, positions, sliding_window):
    if sliding_window is None:
        return True
    return key_pos[None, :] > positions[:, None] - sliding_window


def _decode_part(qg, kv_pool, layer, tables, context_lens, positions, kv_chunk, sliding_window, softcap=None):
    """Part B: row t over keys [0, context_lens[t]) of its own table.

    Rows sorted by context, descending, are fastest (a group stops at its own longest context); any
    order is exact."""
    r, kh, group, d = qg.shape
    gs = min(max(ROW_GROUP, -(-r // MAX_ROW_GROUPS)), r)
    num_groups = -(-r // gs)
    pad = num_groups * gs - r
    padr = lambda x: jnp.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
    qg_p, tables_p, ctx_p, pos_p = padr(qg), padr(tables), padr(context_lens), padr(positions)
    bpc = kv_chunk // kv_pool.shape[3]
    last_row = jnp.max(jnp.where(ctx_p > 0, jnp.arange(ctx_p.shape[0]) + 1, 0))  # rows after it read nothing
    active_groups = (last_row + gs - 1) // gs

    def group_body(g, state):
        rows = lambda x: jax.lax.dynamic_slice_in_dim(x, g * gs, gs, axis=0)  # noqa: E731
        q, tab, ctx, pos = rows(qg_p), rows(tables_p), rows(ctx_p), rows(pos_p)

        def chunk_body(c, carry):
            ids = jax.lax.dynamic_slice_in_dim(tab, c * bpc, bpc, axis=1)
            k = decode(kv_pool[layer, 0, ids]).reshape(gs, kv_chunk, kh, d)  # [gs, C, KH, D]
            v = decode(kv_pool[layer, 1, ids]).reshape(gs, kv_chunk, kh, d)
            key_pos = c * kv_chunk + jnp.arange(kv_chunk)
            visible = (key_pos[None, :] < ctx[:, None]) & _window_mask(key_pos, pos, sliding_window)
            s = jnp.einsum("tkgd,tckd->tkgc", q, k)
            return _merge(carry, _masked_softmax_part(s, visible[:, None, None, :], v, "tkgc,tckd->tkgd", softcap))

        chunks = (jnp.max(ctx) + kv_chunk - 1) // kv_chunk
        part = jax.lax.fori_loop(0, chunks, chunk_body, _empty_state(gs, kh, group, d))
        return tuple(jax.lax.dynamic_update_slice_in_dim(a, p, g * gs, axis=0) for a, p in zip(state, part))

    state = jax.lax.fori_loop(0, active_groups, group_body, _empty_state(num_groups * gs, kh, group, d))
    return tuple(x[:r] for x in state)


def _continuation_part(qg, kv_pool, layer, block_tables, token_seq, positions, seq_context_lens,
                       continuation_rows, kv_chunk, sliding_window, *, window: int = 64, softcap=None):
    """Part C: for each continuation sequence, its new tokens over its cached keys, each chunk gathered once.

    A sequence's tokens are contiguous; they are visited in row windows of `window`, so the work is
    about (its tokens) x (its context), not (all tokens) x (its context).
    """
    t, kh, group, d = qg.shape
    w = min(window, t)
    bpc = kv_chunk // kv_pool.shape[3]
    count = jnp.sum(continuation_rows >= 0)
    pad = lambda x: jnp.pad(x, [(0, w)] + [(0, 0)] * (x.ndim - 1))  # noqa: E731  windows never clamp
    qg_p, seq_p, pos_p = pad(qg), jnp.pad(token_seq, (0, w), constant_values=-1), pad(positions)
    rows_idx = jnp.arange(t)

    def seq_body(i, state):
        row = continuation_rows[i]
        table, ctx = block_tables[row], seq_context_lens[row]
        mine_all = token_seq == row
        first = jnp.min(jnp.where(mine_all, rows_idx, t))
        num_windows = (jnp.sum(mine_all) + w - 1) // w

        def window_body(j, state):
            start = first + j * w
            q = jax.lax.dynamic_slice_in_dim(qg_p, start, w)
            mine = jax.lax.dynamic_slice_in_dim(seq_p, start, w) == row
            pos = jax.lax.dynamic_slice_in_dim(pos_p, start, w)

            def chunk_body(c, carry):
                ids = jax.lax.dynamic_slice_in_dim(table, c * bpc, bpc)
                k = decode(kv_pool[layer, 0, ids]).reshape(kv_chunk, kh, d)  # [C, KH, D]
                v = decode(kv_pool[layer, 1, ids]).reshape(kv_chunk, kh, d)
                key_pos = c * kv_chunk + jnp.arange(kv_chunk)
                visible = mine[:, None] & (key_pos[None, :] < ctx) & _window_mask(key_pos, pos, sliding_window)
                s = jnp.einsum("tkgd,ckd->tkgc", q, k)
                return _merge(carry, _masked_softmax_part(s, visible[:, None, None, :], v, "tkgc,ckd->tkgd",
                                                          softcap))

            part = jax.lax.fori_loop(0, (ctx + kv_chunk - 1) // kv_chunk, chunk_body, _empty_state(w, kh, group, d))
            cur = tuple(jax.lax.dynamic_slice_in_dim(x, start, w) for x in state)
            merged = _merge(cur, part)
            return tuple(jax.lax.dynamic_update_slice_in_dim(x, m, start, axis=0) for x, m in zip(state, merged))

        return jax.lax.fori_loop(0, num_windows, window_body, state)

    state = jax.lax.fori_loop(0, count, seq_body, _empty_state(t + w, kh, group, d))
    return tuple(x[:t] for x in state)


def split_ragged_paged_attention(
    q: Float[Array, "T H D"],
    k_new: Float[Array, "T KH D"],
    v_new: Float[Array, "T KH D"],
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "S B"],
    token_seq: Int[Array, "T"],  # row of block_tables; -1 for padding tokens
    positions: Int[Array, "T"],
    decode_context_lens: Int[Array, "T"],  # cached tokens before a decode token (rows < S only); else 0
    seq_context_lens: Int[Array, "S"],  # cached tokens of each sequence before this step
    continuation_rows: Int[Array, "S"],  # rows of sequences with >1 new token and cached context; -1 pads
    *,
    sm_scale: float,
    sliding_window: int | None = None,
    kv_chunk: int = 32,
    max_query_len: int | None = None,  # most new tokens of one sequence, if known (static); see part A
    softcap: float | None = None,  # scores squashed to softcap * tanh(score / softcap) (Gemma 2)
) -> Float[Array, "T H D"]:
    """Attention of each token over its sequence's cached context and the step's new tokens."""
    t, h, d = q.shape
    kh = k_new.shape[1]
    s = block_tables.shape[0]
    qg = q.reshape(t, kh, h // kh, d).astype(jnp.float32) * sm_scale
    # New tokens' K/V as the pool holds them (rounded to a narrower KV dtype), as later steps and the kernel read
    # them: outputs do not depend on how a prompt is split over steps.
    k_new, v_new = decode(encode(k_new, kv_pool.dtype)), decode(encode(v_new, kv_pool.dtype))
    state = _new_token_part(qg, k_new, v_new, token_seq, positions, sliding_window, max_query_len=max_query_len,
                            softcap=softcap)
    r = min(s, t)
    tables = block_tables[jnp.maximum(token_seq[:r], 0)]
    head = _decode_part(qg[:r], kv_pool, layer, tables, decode_context_lens[:r], positions[:r], kv_chunk,
                        sliding_window, softcap)
    head = _merge(tuple(x[:r] for x in state), head)
    state = tuple(jnp.concatenate([hx, x[r:]]) for hx, x in zip(head, state))
    cont = _continuation_part(qg, kv_pool, layer, block_tables, token_seq, positions, seq_context_lens,
                              continuation_rows, kv_chunk * 4, sliding_window, softcap=softcap)
    m, l, acc = _merge(state, cont)
    l = jnp.where(l > 0, l, 1.0)  # padding tokens see no key
    return (acc / l[..., None]).reshape(t, h, d).astype(q.dtype)

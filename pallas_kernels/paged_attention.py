"""Ragged paged attention: each token attends to its sequence's context in a paged KV pool.

The pool holds every layer: kv_pool[layer, 0] is K and kv_pool[layer, 1] is V, each
[num_blocks, block_size, num_kv_heads, head_dim]. A token's sequence is `token_seq[t]`, whose
context is read through `block_tables[token_seq[t]]`; it sees keys at positions <= positions[t]
(causal within new tokens, the whole cached prefix before them).

Two implementations with one meaning:

- `ragged_paged_attention`: the Pallas kernel, written for Pallas' Triton lowering. The batch is cut
  into query tiles, each a few consecutive tokens of one sequence times the query heads that share
  a KV head (so a decode row still fills a 16-row tile when heads are grouped). One program per
  (tile, KV head) walks its sequence's blocks up to the tile's last position with an online softmax
  in float32. Ragged by construction: no per-sequence padding, prefill chunks and decodes mixed.
- `reference_ragged_paged_attention`: plain JAX. It never copies a layer of the pool: it gathers
  only the blocks it reads, a chunk of context at a time, and stops after the longest context in the
  batch (a dynamic trip count, so context length needs no shape bucket).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jaxtyping import Array, Float, Int

from pallas_kernels.kv_storage import STORAGE, decode

_MASKED = -1e30
# The pool may hold a narrower dtype than q (read up to q's dtype): bf16/f16 or fp8 KV on any model, stored as
# integers (kv_storage) or as plain floats.
KV_POOL_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16, jnp.float8_e4m3fn, jnp.float8_e5m2, *STORAGE.values())


def check_paged_attention_args(q, kv_pool, block_tables, token_seq, positions, kv_chunk: int | None = None) -> None:
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
    if kv_pool.dtype not in KV_POOL_DTYPES:
        raise ValueError(f"kv_pool must be one of {', '.join(str(jnp.dtype(d)) for d in KV_POOL_DTYPES)}, "
                         f"got {kv_pool.dtype}")
    if token_seq.shape != (t,) or positions.shape != (t,):
        raise ValueError(f"token_seq and positions must be [T={t}], got {token_seq.shape}, {positions.shape}")
    if block_tables.ndim != 2:
        raise ValueError(f"block_tables must be [S, B], got shape {block_tables.shape}")
    for name, a in (("block_tables", block_tables), ("token_seq", token_seq), ("positions", positions)):
        if not jnp.issubdtype(a.dtype, jnp.integer):
            raise ValueError(f"{name} must be integer, got {a.dtype}")
    if q.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        raise ValueError(f"q must be float32, bfloat16 or float16, got {q.dtype}")
    if not isinstance(positions, jax.core.Tracer) and positions.size:  # a value check where values are known
        span = block_tables.shape[1] * block_size
        highest = int(np.max(np.asarray(positions)))  # numpy: no tracer even inside a jit that closes over it
        if highest >= span:
            raise ValueError(f"block_tables has {block_tables.shape[1]} blocks per sequence ({span} tokens), "
                             f"too short for position {highest}")
    if kv_chunk is not None and (kv_chunk % block_size or (block_tables.shape[1] * block_size) % kv_chunk):
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
    softcap: float | None = None,
) -> Float[Array, "T H D"]:
    """Attention of each token over keys [0, positions[t]] of sequence token_seq[t], float32 softmax; softcap:
    scores squashed to softcap * tanh(score / softcap) first (Gemma 2)."""
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
        k = decode(kv_pool[layer, 0, ids]).reshape(t, kv_chunk, kh, d)  # [T, C, KH, D] float32
        v = decode(kv_pool[layer, 1, ids]).reshape(t, kv_chunk, kh, d)
        s = jnp.einsum("tkgd,tckd->tkgc", qg, k)  # [T, KH, G, C]
        if softcap:
            s = softcap * jnp.tanh(s / softcap)
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


def query_tiles(token_seq: Int[Array, "T"], block_q: int, num_tiles: int):
    """Cut the token rows into tiles of <= block_q consecutive tokens of one sequence.

    Returns (tile_start, tile_len), each [num_tiles]; unused tiles have length 0. Padding tokens
    (token_seq < 0) belong to no tile. Each sequence's tokens must be one contiguous run of rows (in
    any order of positions); then num_tiles = cdiv(T, block_q) + min(S, T) always suffices.
    """
    t = token_seq.shape[0]
    idx = jnp.arange(t, dtype=jnp.int32)
    valid = token_seq >= 0
    prev = jnp.concatenate([jnp.full((1,), -2, token_seq.dtype), token_seq[:-1]])
    nxt = jnp.concatenate([token_seq[1:], jnp.full((1,), -2, token_seq.dtype)])
    run_first = jax.lax.cummax(jnp.where(valid & (token_seq != prev), idx, 0))
    run_end = jax.lax.cummin(jnp.where(valid & (token_seq != nxt), idx + 1, t), reverse=True)
    is_start = valid & ((idx - run_first) % block_q == 0)
    (start,) = jnp.nonzero(is_start, size=num_tiles, fill_value=t)
    start = start.astype(jnp.int32)
    length = jnp.where(start < t, jnp.minimum(block_q, run_end[jnp.minimum(start, t - 1)] - start), 0)
    return start, length.astype(jnp.int32)


def _ragged_paged_attention_kernel(
    tile_start_ref, tile_len_ref, tile_splits_ref, token_seq_ref, positions_ref, tables_ref, layer_ref, q_ref,
    pool_ref,  # inputs
    *out_refs,  # o [KH, rows, D]; with num_splits > 1, each split's float32 acc [S, KH, rows, D], m and l [S, KH, rows]
    block_q: int, group_pad: int, sm_scale: float, sliding_window: int | None, kv_blocks: int, num_splits: int,
    softcap: float | None,
):
    """One program: query tile pl.program_id(0) (block_q tokens x group_pad heads) of KV head pl.program_id(1),
    over its context kv_blocks blocks per step; with num_splits > 1, split pl.program_id(2) of that walk, of the
    tile's tile_splits_ref[tile] (the programs of higher splits do nothing)."""
    tile, head = pl.program_id(0), pl.program_id(1)
    split = pl.program_id(2) if num_splits > 1 else 0  # (read here: the interpreter maps program ids at top level)
    rows = block_q * group_pad
    block_size = pool_ref.shape[3]
    chunk = kv_blocks * block_size  # context tokens per step of the walk
    start, length = tile_start_ref[tile], tile_len_ref[tile]
    splits = tile_splits_ref[tile] if num_splits > 1 else 1

    @pl.when((length > 0) & (split < splits))
    def _():
        seq = token_seq_ref[start]
        layer = layer_ref[0]
        row_token = start + jax.lax.iota(jnp.int32, rows) // group_pad  # [M]
        row_valid = row_token < start + length
        pos = jnp.where(row_valid, positions_ref[row_token], -1)  # [M]; -1: sees nothing
        q = q_ref[head, pl.ds(start * group_pad, rows), :]  # [M, D]
        last = jnp.max(pos)
        first = 0
        if sliding_window is not None:
            lowest = jnp.min(jnp.where(row_valid, pos, last))
            first = jnp.maximum(lowest - sliding_window + 1, 0) // chunk
        end = last // chunk + 1
        if num_splits > 1:  # this program's share of the steps [first, end)
            per = (end - first + splits - 1) // splits
            first = first + split * per
            end = jnp.minimum(first + per, end)

        def body(c, carry):
            m, l, acc = carry  # [M], [M], [M, D]
            if kv_blocks == 1:
                blk = tables_ref[seq, c]
                k = decode(pool_ref[layer, 0, blk, :, head, :], q.dtype)  # [bs, D]
                v = decode(pool_ref[layer, 1, blk, :, head, :], q.dtype)
            else:  # kv_blocks blocks at once: each key's block id read from the table row; none past `last`
                tok = c * chunk + jax.lax.iota(jnp.int32, chunk)  # [C] context positions
                blk = tables_ref[seq, tok // block_size][:, None]  # [C, 1]
                off, col = (tok % block_size)[:, None], jax.lax.iota(jnp.int32, q.shape[-1])[None, :]  # (all
                seen = (tok <= last)[:, None]  # gathers, no slice: the interpreter takes no mix of the two)
                k = decode(plgpu.load(pool_ref.at[layer, 0, blk, off, head, col], mask=seen, other=0), q.dtype)
                v = decode(plgpu.load(pool_ref.at[layer, 1, blk, off, head, col], mask=seen, other=0), q.dtype)
            s = plgpu.dot(q, k, trans_b=True).astype(jnp.float32) * sm_scale  # [M, C]
            if softcap:
                s = softcap * jnp.tanh(s / softcap)
            key_pos = c * chunk + jax.lax.iota(jnp.int32, chunk)
            visible = key_pos[None, :] <= pos[:, None]
            if sliding_window is not None:
                visible &= key_pos[None, :] > pos[:, None] - sliding_window
            s = jnp.where(visible, s, _MASKED)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.where(visible, jnp.exp(s - m_new[:, None]), 0.0)
            corr = jnp.exp(m - m_new)
            l = l * corr + jnp.sum(p, axis=1)
            acc = acc * corr[:, None] + plgpu.dot(p.astype(v.dtype), v).astype(jnp.float32)
            return m_new, l, acc

        init = (jnp.full((rows,), _MASKED, jnp.float32), jnp.zeros((rows,), jnp.float32),
                jnp.zeros((rows, q.shape[-1]), jnp.float32))
        m, l, acc = jax.lax.fori_loop(first, end, body, init)
        out_rows = pl.ds(start * group_pad, rows)
        if num_splits > 1:  # (an empty split writes its empty state: m -1e30, l 0, acc 0)
            acc_ref, m_ref, l_ref = out_refs
            plgpu.store(acc_ref.at[split, head, out_rows, :], acc, mask=row_valid[:, None])
            plgpu.store(m_ref.at[split, head, out_rows], m, mask=row_valid)
            plgpu.store(l_ref.at[split, head, out_rows], l, mask=row_valid)
        else:
            (o_ref,) = out_refs
            out = acc / jnp.maximum(l, 1e-30)[:, None]
            plgpu.store(o_ref.at[head, out_rows, :], out.astype(o_ref.dtype), mask=row_valid[:, None])


VARIANT_ENV = "JAXPAGED_PALLAS_ATTENTION"


def default_variant(head_dim: int, block_size: int = 16) -> dict[str, int]:
    """The Triton kernel's kv_blocks and num_splits as timed fastest on an H200 (jax 0.11.2, bf16, 16-token
    blocks; `jaxpaged bench kernels --tune`, 2026-12-04, decode at 64-512 sequences of 1k-8k tokens, geometric
    mean against one block a step): 128 keys a step at head_dim <= 64 (8 blocks: 0.62x the time of one;
    SmolLM2's heads; 4 blocks were within 2% of it), 64 above (4 blocks: 0.76x; Llama-3-8B's), as blocks of
    block_size. No split: 8 splits are fastest at 64 and 256 sequences of 8k (0.82x / 0.97x the time of these
    at 64 x 8k) and lose at 512 x 1k, and a step's split count is static while its contexts are not."""
    keys = 128 if head_dim <= 64 else 64
    return {"kv_blocks": max(1, keys // block_size), "num_splits": 1, "fill_programs": 0}


def default_block_m(num_tokens: int, num_seqs: int) -> int:
    """Query rows per tile when a call names none: 64 where the step's shape holds at least 4 tokens per
    sequence slot (prefill-heavy: bigger tiles keep the tensor cores busier), else 16 (decode: one token per
    sequence wastes the rest of a tile). On an H200 (jax 0.11.2, bf16, 2026-12-04, `jaxpaged bench kernels
    --tune`) 64 rows made prefill of 4 x 2,048 tokens 1.63x faster at Llama-3-8B's heads (1.68 -> 1.03 ms,
    82 -> 133 TFLOP/s) and 1.37x at SmolLM2's; 128 rows were slower than 64; the mixed steps' differences were
    within the timer's noise."""
    return 64 if num_tokens >= 4 * num_seqs else 16


def kernel_variant(head_dim: int, block_size: int = 16, num_tokens: int = 1, num_seqs: int = 1) -> dict[str, int]:
    """The Triton kernel's kv_blocks, num_splits, fill_programs, block_m, num_warps and num_stages where a call
    leaves them out: `default_variant`, `default_block_m` and 4 warps, 2 stages, or as $JAXPAGED_PALLAS_ATTENTION
    sets them, e.g. "kv_blocks=8,num_splits=8,fill_programs=2048,block_m=128,num_warps=8,num_stages=3" (read when
    a step is traced: to time the engine with a variant `jaxpaged bench kernels --tune` found faster)."""
    variant = {**default_variant(head_dim, block_size), "block_m": default_block_m(num_tokens, num_seqs),
               "num_warps": 4, "num_stages": 2}
    for item in filter(None, os.environ.get(VARIANT_ENV, "").replace(" ", "").split(",")):
        key, _, value = item.partition("=")
        if key not in variant or not value.isdigit():
            raise ValueError(f"${VARIANT_ENV}: expected kv_blocks=N,num_splits=N,fill_programs=N,block_m=N,"
                             f"num_warps=N,num_stages=N, got {item!r}")
        variant[key] = int(value)
    return variant


def ragged_paged_attention(
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
    block_m: int | None = None,
    kv_blocks: int | None = None,
    num_splits: int | None = None,
    fill_programs: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    interpret: bool = False,
) -> Float[Array, "T H D"]:
    """Pallas (Triton) ragged paged attention; same meaning as `reference_ragged_paged_attention`.

    Args:
      q: [T, H, D] queries of the step's tokens; H = KH * group; D a power of two >= 16.
      kv_pool: [L, 2, N, block_size, KH, D] all layers' K (index 0) and V (index 1); block_size >= 16
        and a power of two. The step's own K/V must already be written (see `write_kv`).
      layer: [] which layer of the pool to read.
      block_tables: [S, B] physical block ids of each sequence's logical blocks.
      token_seq: [T] sequence of each token, -1 for padding (its output row is zero). A sequence's
        tokens are one contiguous run of rows (positions within it in any order).
      positions: [T] each token's position; it sees keys at positions <= its own.
      sm_scale: the softmax scale (static). sliding_window: keys within this many positions (static).
      softcap: scores squashed to softcap * tanh(score / softcap) before the softmax (static; Gemma 2).
      block_m: query rows per tile (tokens x padded group), a power of two >= 16.
      kv_blocks: KV blocks a program reads per step of its walk over the context (a power of two): larger
        loads per step (the block ids gathered from the table) for small blocks and heads.
      num_splits: programs per (tile, KV head), each walking a share of the context (flash-decoding), their
        float32 partial results combined after: more programs in flight for few, long sequences.
      fill_programs: with num_splits > 1, 0 splits every tile num_splits ways; N > 0 splits each tile only as
        far as needed for about N programs in all (over the step's non-empty tiles x KV heads, at most
        num_splits, each split at least 2 steps of the walk), so a step of many or short sequences runs
        unsplit and one of few long ones split, with static shapes: the count is read in the kernel.
      num_warps, num_stages: Triton's, per program (4 and 2 unless the environment says otherwise).
        These six default to `kernel_variant(head_dim, block_size, T, S)` (tuned on an H200 unless
        $JAXPAGED_PALLAS_ATTENTION says otherwise).
      interpret: run through the Pallas interpreter (CPU tests) instead of Triton.
    Returns [T, H, D] in q's dtype.
    """
    check_paged_attention_args(q, kv_pool, block_tables, token_seq, positions)
    if not isinstance(token_seq, jax.core.Tracer):
        seqs = np.asarray(token_seq)
        seqs = seqs[seqs >= 0]
        runs = seqs[np.r_[True, seqs[1:] != seqs[:-1]]]  # first token of each run
        if len(runs) != len(np.unique(runs)):
            raise ValueError("token_seq: each sequence's tokens must be one contiguous run of rows")
    given = dict(block_m=block_m, kv_blocks=kv_blocks, num_splits=num_splits, fill_programs=fill_programs,
                 num_warps=num_warps, num_stages=num_stages)
    if None in given.values():  # (the environment read only where a setting is left out)
        variant = kernel_variant(q.shape[2], kv_pool.shape[3], q.shape[0], block_tables.shape[0])
        given = {k: variant[k] if v is None else v for k, v in given.items()}
    block_m, kv_blocks, num_splits, fill_programs, num_warps, num_stages = given.values()
    for name, n in (("head_dim", q.shape[2]), ("block_size", kv_pool.shape[3]), ("block_m", block_m)):
        if n < 16 or n & (n - 1):
            raise ValueError(f"{name} must be a power of two >= 16 for the Triton kernel, got {n}")
    if kv_blocks < 1 or kv_blocks & (kv_blocks - 1) or num_splits < 1 or fill_programs < 0:
        raise ValueError(f"kv_blocks must be a power of two, num_splits >= 1 and fill_programs >= 0, got "
                         f"{kv_blocks}, {num_splits}, {fill_programs}")
    return _ragged_paged_attention(q, kv_pool, layer, block_tables, token_seq, positions, sm_scale=sm_scale,
                                   sliding_window=sliding_window, softcap=softcap or None, block_m=block_m,
                                   kv_blocks=kv_blocks, num_splits=num_splits, fill_programs=fill_programs,
                                   num_warps=num_warps,
                                   num_stages=num_stages, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("sm_scale", "sliding_window", "softcap", "block_m", "kv_blocks",
                                             "num_splits", "fill_programs", "num_warps", "num_stages", "interpret"))
def _ragged_paged_attention(q, kv_pool, layer, block_tables, token_seq, positions, *, sm_scale, sliding_window,
                            softcap, block_m, kv_blocks, num_splits, fill_programs, num_warps, num_stages,
                            interpret):
    t, h, d = q.shape
    kh = kv_pool.shape[4]
    group = h // kh
    group_pad = pl.next_power_of_2(group)
    block_q = max(1, block_m // group_pad)
    rows = block_q * group_pad
    num_tiles = pl.cdiv(t, block_q) + min(block_tables.shape[0], t)
    token_seq = token_seq.astype(jnp.int32)
    tile_start, tile_len = query_tiles(token_seq, block_q, num_tiles)
    # Queries as [KH, T', group_pad, D] flattened to rows, so one tile's rows are contiguous; T' = T + block_q
    # so a tile's load never runs past the end (the interpreter clamps out-of-range slices).
    tp = t + block_q
    qg = q.reshape(t, kh, group, d)
    qg = jnp.pad(qg, ((0, block_q), (0, 0), (0, group_pad - group), (0, 0)))
    qg = qg.transpose(1, 0, 2, 3).reshape(kh, tp * group_pad, d)
    pad_tok = lambda x, fill: jnp.pad(x, (0, block_q), constant_values=fill)  # noqa: E731
    tables = block_tables.astype(jnp.int32)
    if tables.shape[1] % kv_blocks:  # whole steps of kv_blocks: pad with block 0 (its keys are masked)
        tables = jnp.pad(tables, ((0, 0), (0, kv_blocks - tables.shape[1] % kv_blocks)))
    kernel = functools.partial(_ragged_paged_attention_kernel, block_q=block_q, group_pad=group_pad,
                               sm_scale=sm_scale, sliding_window=sliding_window, kv_blocks=kv_blocks,
                               num_splits=num_splits, softcap=softcap)
    if num_splits == 1:
        out_shape = jax.ShapeDtypeStruct((kh, tp * group_pad, d), q.dtype)
    else:
        out_shape = (jax.ShapeDtypeStruct((num_splits, kh, tp * group_pad, d), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, kh, tp * group_pad), jnp.float32),
                     jax.ShapeDtypeStruct((num_splits, kh, tp * group_pad), jnp.float32))
    positions = positions.astype(jnp.int32)
    tile_splits = jnp.full((num_tiles,), num_splits, jnp.int32)
    if num_splits > 1 and fill_programs:
        tile_splits = splits_per_tile(tile_start, tile_len, positions, kh, kv_blocks * kv_pool.shape[3],
                                      num_splits, fill_programs, sliding_window)
    out = pl.pallas_call(
        kernel,
        grid=(num_tiles, kh) + ((num_splits,) if num_splits > 1 else ()),
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name=f"ragged_paged_attention_m{rows}" + (f"_kv{kv_blocks}" if kv_blocks > 1 else "")
        + (f"_split{num_splits}" if num_splits > 1 else "") + (f"_fill{fill_programs}" if num_splits > 1
                                                                 and fill_programs else ""),
    )(tile_start, tile_len, tile_splits, pad_tok(token_seq, -1), pad_tok(positions, 0),
      tables, jnp.reshape(layer, (1,)).astype(jnp.int32), qg, kv_pool)
    if num_splits > 1:
        tile_of_token, in_tile = tiles_of_tokens(tile_start, tile_len, tp)
        token_splits = jnp.where(in_tile, tile_splits[tile_of_token], 1)
        written = jnp.arange(num_splits)[:, None] < jnp.repeat(token_splits, group_pad)[None, :]  # [S, rows]
        out = combine_splits(*out, written[:, None, :]).astype(q.dtype)
    out = out.reshape(kh, tp, group_pad, d)[:, :t, :group].transpose(1, 0, 2, 3).reshape(t, h, d)
    return jnp.where((token_seq >= 0)[:, None, None], out, 0).astype(q.dtype)


def tiles_of_tokens(tile_start: Int[Array, "N"], tile_len: Int[Array, "N"], num_tokens: int):
    """Each token row's query tile (`query_tiles`' order: starts ascending, unused tiles last) and whether it is
    in one (padding rows are not): ([num_tokens] tile index, [num_tokens] bool)."""
    rows = jnp.arange(num_tokens, dtype=jnp.int32)
    tile = jnp.maximum(jnp.searchsorted(tile_start, rows, side="right") - 1, 0)
    return tile, (rows >= tile_start[tile]) & (rows < tile_start[tile] + tile_len[tile])


def splits_per_tile(tile_start: Int[Array, "N"], tile_len: Int[Array, "N"], positions: Int[Array, "T"],
                    kv_heads: int, chunk: int, num_splits: int, fill_programs: int, sliding_window: int | None
                    ) -> Int[Array, "N"]:
    """How many programs split each query tile's walk over its context: enough for ~fill_programs programs over
    the non-empty tiles x KV heads, at most num_splits, and no more than gives each split 2 steps of `chunk`
    keys (a short context runs whole)."""
    tile_of_token, in_tile = tiles_of_tokens(tile_start, tile_len, positions.shape[0])
    last = jax.ops.segment_max(jnp.where(in_tile, positions, 0), tile_of_token,
                               num_segments=tile_start.shape[0])  # [N] the tile's last position
    keys = jnp.maximum(last, 0) + 1
    if sliding_window is not None:
        keys = jnp.minimum(keys, sliding_window + tile_len)
    steps = (keys + chunk - 1) // chunk
    busy = jnp.maximum(jnp.sum(tile_len > 0) * kv_heads, 1)
    wanted = jnp.minimum((fill_programs + busy - 1) // busy, (steps + 1) // 2)
    return jnp.clip(wanted, 1, num_splits).astype(jnp.int32)


def combine_splits(acc: Float[Array, "S KH R D"], m: Float[Array, "S KH R"], l: Float[Array, "S KH R"],
                   written: jax.Array | None = None) -> Float[Array, "KH R D"]:
    """Softmax-weighted merge of the splits' partial results (each over its own keys): rows no split saw
    (padding) come out 0 or garbage, masked by the caller. written: [S, 1 or KH, R] bool, False where a split's
    program did not run (its outputs are left as they were: garbage, weighed 0)."""
    if written is not None:
        m = jnp.where(written, m, _MASKED)
        l = jnp.where(written, l, 0.0)
        acc = jnp.where(written[..., None], acc, 0.0)
    top = jnp.max(m, axis=0)  # [KH, R]
    w = jnp.exp(m - top)  # [S, KH, R]; an empty split (m = -1e30) weighs 0
    num = jnp.sum(w[..., None] * acc, axis=0)
    return num / jnp.maximum(jnp.sum(w * l, axis=0), 1e-30)[..., None]

"""Paged decode attention in Pallas' Mosaic GPU dialect (Hopper, sm90): TMA loads of whole KV blocks, wgmma.

An experiment beside the Triton kernel (`paged_attention.py`), for decode steps only: one query token per
sequence. One program per (sequence, KV head) walks the sequence's block table 64 keys at a time, `stages`
steps in flight (a TMA copy of each block's [block_size, head_dim] K and V tiles into one swizzled
[64, head_dim] tile per step, with a barrier per tile), scores the KV head's query group against each step
with wgmma (the group padded to wgmma's 64 rows) and keeps an online softmax in registers. Lowers off GPU
(`lowering_platforms=("cuda",)`) on jax 0.10-0.12; runs only on sm90, and the Pallas interpreter cannot run
its TMA copies. `jaxpaged bench kernels --tune` times it beside the Triton variants on the decode cases.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu
from jaxtyping import Array, Float, Int

ROWS = 64  # wgmma's M: the query group (heads per KV head) padded to it
KEYS = 64  # keys per step of the walk (wgmma's K for P @ V with a 128-byte swizzle): several KV blocks
SMEM_BYTES = 227 << 10  # an sm90 block's shared memory


def decode_paged_attention_mgpu(
    q: Float[Array, "S H D"],
    kv_pool: Float[Array, "L 2 N bs KH D"],
    layer: Int[Array, ""],
    block_tables: Int[Array, "S B"],
    seq_lens: Int[Array, "S"],
    *,
    sm_scale: float,
    stages: int = 2,
) -> Float[Array, "S H D"]:
    """Attention of each sequence's one new token (q row s, already written to the pool at position
    seq_lens[s] - 1) over its seq_lens[s] keys. bf16/f16 only; head_dim a multiple of 64."""
    s, h, d = q.shape
    num_layers, _, n, bs, kh, _ = kv_pool.shape
    g = h // kh
    if h % kh or g > ROWS:
        raise ValueError(f"query heads {h} must be a multiple of KV heads {kh}, at most {ROWS} per KV head")
    if d % 64 or d > 256 or q.dtype not in (jnp.bfloat16, jnp.float16) or kv_pool.dtype != q.dtype:
        raise ValueError(f"needs head_dim a multiple of 64 up to 256 (wgmma's N) and bf16/f16 q and pool, got "
                         f"{d}, {q.dtype}, {kv_pool.dtype}")
    if KEYS % bs or bs % 8:
        raise ValueError(f"block_size {bs} must divide {KEYS} and be a multiple of 8 (the shared tiles' rows)")
    smem = ROWS * d * 2 * (1 + 2 * stages)  # the queries' tile and `stages` K and V tiles, 2 bytes each
    if smem > SMEM_BYTES:
        raise ValueError(f"{stages} stages at head_dim {d} need {smem >> 10} KiB of shared memory, more than "
                         f"{SMEM_BYTES >> 10}")
    return _decode(q, kv_pool, layer, block_tables, seq_lens, sm_scale=sm_scale, stages=stages)


@functools.partial(jax.jit, static_argnames=("sm_scale", "stages"))
def _decode(q, kv_pool, layer, block_tables, seq_lens, *, sm_scale, stages):
    s, h, d = q.shape
    num_layers, _, n, bs, kh, _ = kv_pool.shape
    g = h // kh
    dtype = q.dtype
    per_step = KEYS // bs
    # queries [S, KH, 64, D] with the group's rows first and zeros after; the pool as rows of tokens (a free
    # reshape): K of (layer, block) at rows ((layer * 2) * N + block) * bs, V N * bs rows further
    qp = jnp.pad(q.reshape(s, kh, g, d), ((0, 0), (0, 0), (0, ROWS - g), (0, 0)))
    pool = kv_pool.reshape(num_layers * 2 * n * bs, kh * d)
    k_base = layer.astype(jnp.int32) * (2 * n * bs)
    scalars = jnp.stack([k_base, k_base + n * bs]).astype(jnp.int32)
    log2e = 1.4426950408889634

    def kernel(q_gmem, pool_gmem, tables_gmem, lens_gmem, scalars_gmem, o_gmem, q_smem, k_smem, v_smem,
               q_bar, k_bar, v_bar):
        seq, head = lax.axis_index("seq"), lax.axis_index("kvh")
        length = lens_gmem[seq]
        steps = (length + KEYS - 1) // KEYS
        last = jnp.minimum((length + bs - 1) // bs - 1, tables_gmem.shape[1] - 1)  # (never past the table)
        k_row0, v_row0 = scalars_gmem[0], scalars_gmem[1]

        def fetch(step, slot):  # the step's blocks (clamped to the sequence's last: keys past it are masked)
            cols = pl.ds(pl.multiple_of(head * d, d), d)
            for i in range(per_step):
                block = tables_gmem[seq, jnp.minimum(step * per_step + i, last)]
                rows = pl.ds(i * bs, bs)
                k_rows = pl.ds(pl.multiple_of(k_row0 + block * bs, bs), bs)
                v_rows = pl.ds(pl.multiple_of(v_row0 + block * bs, bs), bs)
                plgpu.copy_gmem_to_smem(pool_gmem.at[k_rows, cols], k_smem.at[slot, rows], k_bar.at[slot])
                plgpu.copy_gmem_to_smem(pool_gmem.at[v_rows, cols], v_smem.at[slot, rows], v_bar.at[slot])

        plgpu.copy_gmem_to_smem(q_gmem.at[seq, head], q_smem, q_bar.at[0])
        for i in range(stages):
            pl.when(i < steps)(functools.partial(fetch, i, i))
        plgpu.barrier_wait(q_bar.at[0])

        m_i = plgpu.layout_cast(jnp.full((ROWS,), -jnp.inf, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(jnp.full((ROWS,), 0, jnp.float32), plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((ROWS, d), 0, jnp.float32), plgpu.Layout.WGMMA)

        def body(step, carry):
            acc, m_i, l_i = carry
            slot = lax.rem(step, jnp.int32(stages))
            plgpu.barrier_wait(k_bar.at[slot])

            def scores(acc_ref):
                plgpu.wgmma(acc_ref, q_smem, plgpu.transpose_ref(k_smem.at[slot], (1, 0)))
                return acc_ref[...]

            qk = pl.run_scoped(scores, plgpu.ACC((ROWS, KEYS), jnp.float32)) * (sm_scale * log2e)
            key = plgpu.broadcasted_iota(jnp.int32, (ROWS, KEYS), 1, layout=plgpu.Layout.WGMMA) + step * KEYS
            qk = jnp.where(key < length, qk, -jnp.inf)
            m_new = jnp.maximum(m_i, qk.max(axis=1))
            alpha = jnp.exp2(m_i - m_new)
            p = jnp.exp2(qk - lax.broadcast_in_dim(m_new, qk.shape, [0]))
            l_i = l_i * alpha + p.sum(axis=1)
            acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
            plgpu.barrier_wait(v_bar.at[slot])

            def values(acc_ref):
                plgpu.wgmma(acc_ref, p.astype(dtype), v_smem.at[slot])

            acc = pl.run_state(values)(plgpu.ACC.init(acc))
            pl.when(step + stages < steps)(lambda: fetch(step + stages, slot))
            return acc, m_new, l_i

        acc, m_i, l_i = lax.fori_loop(0, steps, body, (acc, m_i, l_i))
        acc = acc / lax.broadcast_in_dim(jnp.maximum(l_i, 1e-30), acc.shape, [0])
        q_smem[...] = acc.astype(dtype)  # (the queries are no longer needed: the output leaves through their tile)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(q_smem, o_gmem.at[seq, head])
        plgpu.wait_smem_to_gmem(0)

    def entry(q_gmem, pool_gmem, tables_gmem, lens_gmem, scalars_gmem, o_gmem):
        swizzle = 128 if d * jnp.dtype(dtype).itemsize >= 128 else 64
        transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                      plgpu.SwizzleTransform(swizzle))
        pl.run_scoped(
            lambda *refs: kernel(q_gmem, pool_gmem, tables_gmem, lens_gmem, scalars_gmem, o_gmem, *refs),
            plgpu.SMEM((ROWS, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, KEYS, d), dtype, transforms=transforms),
            plgpu.SMEM((stages, KEYS, d), dtype, transforms=transforms),
            plgpu.Barrier(num_barriers=1),
            plgpu.Barrier(num_arrivals=per_step, num_barriers=stages),  # (each block's copy arrives once)
            plgpu.Barrier(num_arrivals=per_step, num_barriers=stages),
        )

    out = plgpu.kernel(
        entry,
        out_type=jax.ShapeDtypeStruct((s, kh, ROWS, d), dtype),
        grid=(s, kh),
        grid_names=("seq", "kvh"),
        compiler_params=plgpu.CompilerParams(approx_math=True),
    )(qp, pool, block_tables.astype(jnp.int32), seq_lens.astype(jnp.int32), scalars)
    return out[:, :, :g].reshape(s, h, d)

"""Whole-block moves in the KV pool: copy-on-write copies, and copies to and from host memory (swap preemption,
the offload tiers), where a block is one contiguous row [L, 2, bs, KH, D].

Each runs as a small precompiled executable on a fixed chunk of block ids (padding ids point past
the pool, so their writes drop), with the pool donated, so a move of any size compiles nothing
after warmup and never copies the pool.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Float, Int

CHUNK = 32  # block ids per call


def _copy(kv_pool: Float[Array, "L 2 N bs KH D"], src: Int[Array, "C"], dst: Int[Array, "C"]):
    return kv_pool.at[:, :, dst].set(kv_pool[:, :, src], mode="drop")


def _gather_rows(kv_pool: Float[Array, "L 2 N bs KH D"], ids: Int[Array, "C"]):
    return jnp.moveaxis(kv_pool[:, :, ids], 2, 0)  # [C, L, 2, bs, KH, D]: one contiguous row per block


def _scatter_rows(kv_pool: Float[Array, "L 2 N bs KH D"], ids: Int[Array, "C"], rows: Float[Array, "C L 2 bs KH D"]):
    return kv_pool.at[:, :, ids].set(jnp.moveaxis(rows, 0, 2), mode="drop")


class BlockTransfer:
    """Compiled block moves for one pool shape."""

    def __init__(self, kv_pool):
        self.num_blocks = kv_pool.shape[2]
        ids = np.zeros(CHUNK, np.int32)
        keep = kv_pool.sharding  # (tensor parallelism: the pool stays sharded by KV heads)
        self._copy = jax.jit(_copy, donate_argnums=0, out_shardings=keep).lower(kv_pool, ids, ids).compile()
        rows = jax.ShapeDtypeStruct((CHUNK, *kv_pool.shape[:2], *kv_pool.shape[3:]), kv_pool.dtype)
        self._gather_rows = jax.jit(_gather_rows).lower(kv_pool, ids).compile()
        self._scatter_rows = jax.jit(_scatter_rows, donate_argnums=0, out_shardings=keep).lower(
            kv_pool, ids, rows).compile()

    def _chunks(self, ids: list[int], fill: int):
        for i in range(0, len(ids), CHUNK):
            part = ids[i : i + CHUNK]
            yield i, len(part), np.asarray(part + [fill] * (CHUNK - len(part)), np.int32)

    def copy(self, kv_pool, pairs: list[tuple[int, int]]):
        """Copy block src -> dst for each pair, in order; returns the new pool."""
        src, dst = [p[0] for p in pairs], [p[1] for p in pairs]
        for (_, _, s), (_, _, d) in zip(self._chunks(src, 0), self._chunks(dst, self.num_blocks)):
            kv_pool = self._copy(kv_pool, s, d)
        return kv_pool

    def read(self, kv_pool, ids: list[int], out: np.ndarray, rows: list[int]) -> None:
        """Copy blocks `ids` into `out[rows]` (`out`: [R, L, 2, bs, KH, D] on the host, a block per row)."""
        for i, n, c in self._chunks(ids, 0):
            out[rows[i : i + n]] = np.asarray(self._gather_rows(kv_pool, c))[:n]

    def write(self, kv_pool, ids: list[int], data: np.ndarray, rows: list[int]):
        """Write host rows `data[rows]` ([R, L, 2, bs, KH, D]) into blocks `ids`; returns the new pool."""
        chunk = np.zeros((CHUNK, *data.shape[1:]), data.dtype)
        for i, n, c in self._chunks(ids, self.num_blocks):
            chunk[:n] = data[rows[i : i + n]]
            kv_pool = self._scatter_rows(kv_pool, c, chunk)
        return kv_pool

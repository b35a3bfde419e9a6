"""Whole-block moves (copy-on-write copies, to and from host rows) against numpy, across several 32-block chunks."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jaxpaged.runner.block_transfer import CHUNK, BlockTransfer

L, N, BS, KH, D = 2, 160, 4, 2, 8


def pool(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(L, 2, N, BS, KH, D)).astype(np.float32)


def test_moves_of_more_than_one_chunk_equal_numpy():
    n = 2 * CHUNK + 7  # three chunks, the last one partial
    rng = np.random.default_rng(1)
    ids = rng.permutation(np.arange(1, N))
    src, dst = ids[:n].tolist(), ids[n : 2 * n].tolist()
    host = pool(0)
    t = BlockTransfer(jnp.asarray(host))

    copied = np.asarray(t.copy(jnp.asarray(host), list(zip(src, dst))))
    want = host.copy()
    want[:, :, dst] = host[:, :, src]
    np.testing.assert_array_equal(copied, want)

    rows = rng.permutation(3 * n)[:n].tolist()  # host rows of one block each, in any order
    out = np.zeros((3 * n, L, 2, BS, KH, D), np.float32)
    t.read(jnp.asarray(host), src, out, rows)
    np.testing.assert_array_equal(out[rows], np.moveaxis(host[:, :, src], 2, 0))

    data = rng.normal(size=(3 * n, L, 2, BS, KH, D)).astype(np.float32)  # host rows
    written = np.asarray(t.write(jnp.asarray(host), dst, data, rows))
    want = host.copy()
    want[:, :, dst] = np.moveaxis(data[rows], 0, 2)
    np.testing.assert_array_equal(written, want)

"""Whole-block moves (copy-on-write copies, swap out, swap in) against numpy, across several 32-block chunks."""

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

    np.testing.assert_array_equal(t.read(jnp.asarray(host), src), host[:, :, src])

    data = pool(2)[:, :, :n]
    written = np.asarray(t.write(jnp.asarray(host), dst, data))
    want = host.copy()
    want[:, :, dst] = data
    np.testing.assert_array_equal(written, want)

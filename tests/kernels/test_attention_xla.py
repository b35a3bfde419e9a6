"""The split XLA attention (new tokens dense + cached context gathered) equals the pool-only reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.attention import write_kv
from jaxpaged.attention_xla import split_ragged_paged_attention
from pallas_kernels.paged_attention import reference_ragged_paged_attention


def make_step(rng, seqs, *, block_size=16, kh=2, group=3, d=16, table_width=16, num_blocks=80, layers=2,
              dtype=jnp.float32):
    """seqs: list of (context_len, new_tokens). Returns all inputs, tokens with context first."""
    h = kh * group
    pool = jnp.asarray(rng.normal(size=(layers, 2, num_blocks, block_size, kh, d)), dtype)
    perm = rng.permutation(np.arange(1, num_blocks))
    tables = np.zeros((len(seqs), table_width), np.int32)
    token_seq, positions, context_lens, slots = [], [], [], []
    used = 0
    for i, (ctx, n) in enumerate(seqs):
        nb = -(-(ctx + n) // block_size)
        tables[i, :nb] = perm[used : used + nb]
        used += nb
        pos = np.arange(ctx, ctx + n)
        token_seq += [i] * n
        positions += pos.tolist()
        context_lens += [ctx] * n
        slots += (tables[i, pos // block_size] * block_size + pos % block_size).tolist()
    t = len(token_seq) + 3  # three padding tokens
    pad = num_blocks * block_size
    arr = lambda x, fill: jnp.asarray(np.array(x + [fill] * 3, np.int32))  # noqa: E731
    q = jnp.asarray(rng.normal(size=(t, h, d)), dtype)
    k = jnp.asarray(rng.normal(size=(t, kh, d)), dtype)
    v = jnp.asarray(rng.normal(size=(t, kh, d)), dtype)
    return dict(q=q, k=k, v=v, pool=pool, tables=jnp.asarray(tables), token_seq=arr(token_seq, -1),
                positions=arr(positions, 0), context_lens=arr(context_lens, 0), slots=arr(slots, pad),
                real=len(token_seq))


CASES = {
    "decode only": [(5, 1), (16, 1), (17, 1), (100, 1)],
    "fresh prefills": [(0, 7), (0, 16), (0, 33)],
    "mixed": [(40, 1), (31, 1), (20, 12), (0, 9)],  # a continuation chunk that starts mid-block
    "block boundary": [(15, 1), (16, 1), (32, 16), (0, 1)],
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("context_rows", [64, 2])  # 2: context tokens spill past the fast rows
@pytest.mark.parametrize("window", [None, 8])
def test_split_attention_matches_pool_reference(case, context_rows, window):
    rng = np.random.default_rng(0)
    x = make_step(rng, CASES[case])
    layer = jnp.int32(1)
    pool = write_kv(x["pool"], layer, x["k"], x["v"], x["slots"])
    ref = reference_ragged_paged_attention(x["q"], pool, layer, x["tables"], jnp.maximum(x["token_seq"], 0),
                                           x["positions"], sm_scale=0.25, sliding_window=window, kv_chunk=32)
    got = split_ragged_paged_attention(x["q"], x["k"], x["v"], pool, layer, x["tables"], x["token_seq"],
                                       x["positions"], x["context_lens"], sm_scale=0.25, context_rows=context_rows,
                                       sliding_window=window, kv_chunk=32)
    n = x["real"]
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(ref[:n]), rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


def test_padding_writes_are_dropped():
    rng = np.random.default_rng(1)
    x = make_step(rng, [(0, 4)])
    pool = write_kv(x["pool"], jnp.int32(0), x["k"], x["v"], x["slots"])
    changed = np.argwhere(np.asarray(pool != x["pool"]).any(axis=(3, 4, 5)))
    assert {tuple(c) for c in changed[:, :2]} <= {(0, 0), (0, 1)}  # only layer 0 written
    assert len({c[2] for c in changed}) == 1  # four tokens: one block

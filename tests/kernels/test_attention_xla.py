"""The split XLA attention (new tokens dense + cached context gathered) equals the pool-only reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxpaged.layers.attention import write_kv
from jaxpaged.layers.attention_xla import split_ragged_paged_attention
from pallas_kernels.paged_attention import reference_ragged_paged_attention
from tests.kernels.attention_inputs import make_step

CASES = {
    "decode only": [(5, 1), (16, 1), (17, 1), (100, 1)],
    "fresh prefills": [(0, 7), (0, 16), (0, 33)],
    "mixed": [(40, 1), (31, 1), (20, 12), (0, 9)],  # a continuation chunk that starts mid-block
    "block boundary": [(15, 1), (16, 1), (32, 16), (0, 1)],
    "two continuations": [(9, 1), (20, 12), (47, 3), (0, 5)],
    "long continuations": [(20, 70), (5, 1), (33, 66), (0, 3)],  # several 64-row windows per sequence
    "many decodes": [(c, 1) for c in (3, 90, 17, 33, 64, 1, 120, 48, 5, 77, 30, 9, 60, 100, 2, 41, 16, 15, 80, 7)],
    # (20 rows: more than one row group)
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("window", [None, 8])
def test_split_attention_matches_pool_reference(case, window):
    rng = np.random.default_rng(0)
    x = make_step(rng, CASES[case])
    layer = jnp.int32(1)
    pool = write_kv(x["pool"], layer, x["k"], x["v"], x["slots"])
    ref = reference_ragged_paged_attention(x["q"], pool, layer, x["tables"], jnp.maximum(x["token_seq"], 0),
                                           x["positions"], sm_scale=0.25, sliding_window=window, kv_chunk=32)
    got = split_ragged_paged_attention(x["q"], x["k"], x["v"], pool, layer, x["tables"], x["token_seq"],
                                       x["positions"], x["decode_ctx"], x["seq_ctx"], x["cont_rows"],
                                       sm_scale=0.25, sliding_window=window, kv_chunk=16)
    n = x["real"]
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(ref[:n]), rtol=1e-5, atol=1e-5)
    assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("case", ["mixed", "long continuations", "many decodes"])
def test_soft_capped_scores_match_the_reference(case):
    """Gemma 2's soft-capped scores (cap * tanh(score / cap)), on every path of the split attention; a cap of 1.5
    changes these outputs by ~0.1-1, so a path that skipped it would fail."""
    x = make_step(np.random.default_rng(3), CASES[case])
    layer = jnp.int32(1)
    pool = write_kv(x["pool"], layer, x["k"], x["v"], x["slots"])
    ref = lambda cap: reference_ragged_paged_attention(  # noqa: E731
        x["q"], pool, layer, x["tables"], jnp.maximum(x["token_seq"], 0), x["positions"], sm_scale=0.5,
        kv_chunk=32, softcap=cap)
    got = split_ragged_paged_attention(x["q"], x["k"], x["v"], pool, layer, x["tables"], x["token_seq"],
                                       x["positions"], x["decode_ctx"], x["seq_ctx"], x["cont_rows"],
                                       sm_scale=0.5, kv_chunk=16, softcap=1.5)
    n = x["real"]
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(ref(1.5)[:n]), rtol=1e-5, atol=1e-5)
    assert np.abs(np.asarray(ref(None)[:n]) - np.asarray(ref(1.5)[:n])).max() > 0.1


def _check_against_reference(x, **kwargs):
    layer = jnp.int32(1)
    pool = write_kv(x["pool"], layer, x["k"], x["v"], x["slots"])
    ref = reference_ragged_paged_attention(x["q"], pool, layer, x["tables"], jnp.maximum(x["token_seq"], 0),
                                           x["positions"], sm_scale=0.25, kv_chunk=32)
    got = split_ragged_paged_attention(x["q"], x["k"], x["v"], pool, layer, x["tables"], x["token_seq"],
                                       x["positions"], x["decode_ctx"], x["seq_ctx"], x["cont_rows"],
                                       sm_scale=0.25, kv_chunk=16, **kwargs)
    n = x["real"]
    np.testing.assert_allclose(np.asarray(got[:n]), np.asarray(ref[:n]), rtol=1e-5, atol=1e-5)


def test_new_token_window_with_max_query_len():
    """Many sequences' new tokens spanning several 128-row tiles, read with a key window of max_query_len
    (what functional prefill passes): equal to the reference. A window one short loses keys and fails."""
    rng = np.random.default_rng(2)
    seqs = [(0, 40)] * 4 + [(0, 27), (0, 70), (20, 33), (0, 1), (9, 70)]  # rows 187..256: across a tile edge
    x = make_step(rng, seqs, runner_order=False, num_blocks=200)
    _check_against_reference(x, max_query_len=70)
    with pytest.raises(AssertionError):
        _check_against_reference(x, max_query_len=69)


def test_decode_rows_in_any_order():
    """Decode rows need not be sorted by context: 10 rows without context first, then 10 with context (rows of
    two groups of 16, though fewer than 16 have context) are all read."""
    rng = np.random.default_rng(3)
    seqs = [(0, 1)] * 10 + [(c, 1) for c in (3, 90, 17, 33, 64, 1, 120, 48, 5, 77)]
    _check_against_reference(make_step(rng, seqs, runner_order=False, num_blocks=200))


def test_padding_writes_are_dropped():
    rng = np.random.default_rng(1)
    x = make_step(rng, [(0, 4)])
    pool = write_kv(x["pool"], jnp.int32(0), x["k"], x["v"], x["slots"])
    changed = np.argwhere(np.asarray(pool != x["pool"]).any(axis=(3, 4, 5)))
    assert {tuple(c) for c in changed[:, :2]} <= {(0, 0), (0, 1)}  # only layer 0 written
    assert len({c[2] for c in changed}) == 1  # four tokens: one block

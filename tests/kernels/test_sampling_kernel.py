"""The sort-free Pallas sampler draws from exactly the filtered distribution (interpreter) and lowers for CUDA."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sampling import reference_top_k_top_p_sampling, top_k_top_p_mask, top_k_top_p_sampling
from tests.kernels.cuda_lowering import lower_for_cuda
from tests.kernels.test_sampling_reference import assert_draws_follow, filtered_probs

N = 20_000


def draw(logits, temperature, k, p, *, tile, key=7, row_splits=1):
    n = logits.shape[0]
    return np.asarray(top_k_top_p_sampling(
        jnp.asarray(logits), jax.random.PRNGKey(key), jnp.full(n, temperature), jnp.full(n, k, jnp.int32),
        jnp.full(n, p, jnp.float32), tile=tile, row_splits=row_splits, interpret=True))


# (temperature, k, p): off, top-k alone, top-p alone, both, k=1, p near 0, k >= vocab, both with k > kept-by-p.
SETTINGS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9), (1.0, 1, 1.0), (1.0, 0, 1e-6),
            (1.0, 500, 1.0), (2.0, 12, 0.6)]


@pytest.mark.parametrize("temperature,k,p", SETTINGS)
@pytest.mark.parametrize("vocab,tile", [(24, 1024), (200, 32)])  # one tile; seven tiles (draws cross tiles)
def test_draws_follow_the_filtered_distribution(temperature, k, p, vocab, tile):
    logits = np.random.default_rng(vocab).normal(size=vocab).astype(np.float32) * 2
    want = filtered_probs(logits, temperature, k, p)
    assert_draws_follow(draw(np.tile(logits, (N, 1)), temperature, k, p, tile=tile), want)


@pytest.mark.parametrize("temperature,k,p", [(1.0, 0, 1.0), (1.0, 6, 0.9), (2.0, 12, 0.6)])
@pytest.mark.parametrize("row_splits", [2, 8])  # 7 tiles: parts of 4 and 3 tiles; 8 parts of 1 tile, one empty
def test_first_pass_split_over_programs_draws_the_same_distribution(temperature, k, p, row_splits):
    """row_splits: the first pass (max, argmax, lane sums) made by several programs per row and merged."""
    logits = np.random.default_rng(200).normal(size=200).astype(np.float32) * 2
    want = filtered_probs(logits, temperature, k, p)
    got = draw(np.tile(logits, (N, 1)), temperature, k, p, tile=32, row_splits=row_splits)
    assert_draws_follow(got, want)
    # the same uniforms, so the same tokens as one program per row (the merged lane sums equal its own)
    same = draw(np.tile(logits, (64, 1)), temperature, k, p, tile=32, row_splits=row_splits)
    np.testing.assert_array_equal(same, draw(np.tile(logits, (64, 1)), temperature, k, p, tile=32))


@pytest.mark.parametrize("row_splits", [1, 4])
def test_mixed_rows_greedy_minus_inf_and_determinism(row_splits):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(6, 300)).astype(np.float32)
    logits[4, :] = -np.inf
    logits[4, 17] = 0.5  # one finite token (as after allowed_token_ids)
    temp = jnp.array([0.0, 1.0, 0.8, 1.0, 1.0, 0.0])
    k = jnp.array([0, 3, 0, 7, 4, 0], jnp.int32)
    p = jnp.array([1.0, 1.0, 0.5, 0.3, 0.9, 1.0], jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), 6)
    a = np.asarray(top_k_top_p_sampling(jnp.asarray(logits), keys, temp, k, p, tile=64, row_splits=row_splits,
                                        interpret=True))
    b = np.asarray(top_k_top_p_sampling(jnp.asarray(logits), keys, temp, k, p, tile=64, row_splits=row_splits,
                                        interpret=True))
    np.testing.assert_array_equal(a, b)
    assert a[0] == logits[0].argmax() and a[5] == logits[5].argmax() and a[4] == 17
    assert a[1] in np.argsort(-logits[1])[:3]
    # The same key per row gives the same token whatever the other rows are.
    alone = top_k_top_p_sampling(jnp.asarray(logits[1:2]), keys[1:2], temp[1:2], k[1:2], p[1:2], tile=64,
                                 interpret=True)
    assert int(alone[0]) == a[1]


def test_same_distribution_as_the_reference():
    logits = np.tile(np.random.default_rng(9).normal(size=100).astype(np.float32), (N, 1))
    args = (jax.random.PRNGKey(3), jnp.full(N, 0.9), jnp.full(N, 20, jnp.int32), jnp.full(N, 0.85))
    want = filtered_probs(logits[0], 0.9, 20, 0.85)
    assert_draws_follow(np.asarray(top_k_top_p_sampling(jnp.asarray(logits), *args, tile=32, interpret=True)), want)
    assert_draws_follow(np.asarray(reference_top_k_top_p_sampling(jnp.asarray(logits), *args)), want)


@pytest.mark.parametrize("k,p", [(3, 1.0), (3, 0.95), (40, 1.0)])
def test_ties_at_the_top_k_boundary_are_kept(k, p):
    """Logits in steps of 0.5 (many ties): the k-th largest value's ties all stay, as in the reference's mask
    (and vLLM's: a token is cut only when k tokens are strictly more likely)."""
    logits = np.round(np.random.default_rng(5).normal(size=200) * 2) / 2
    logits[:4] = [4.0, 3.0, 3.0, 3.0]  # (k=3: the k-th value 3.0 held by three tokens)
    logits = logits.astype(np.float32)
    masked = np.asarray(top_k_top_p_mask(jnp.asarray(logits[None]), jnp.array([k]), jnp.array([p])))[0]
    want = np.where(masked > -np.inf, np.exp(logits - logits.max()), 0.0)
    assert (want > 0).sum() > k  # (the ties are there)
    assert_draws_follow(draw(np.tile(logits, (N, 1)), 1.0, k, p, tile=32), want / want.sum())


@pytest.mark.parametrize("row_splits", [1, 4])
def test_kth_largest_search_and_greedy_rows_over_many_tiles(row_splits):
    """Rows of 3,000 logits in 47 tiles: top-k in the hundreds with top-p (the k-th largest found by pivot passes),
    ties at the k-th value, greedy rows whose largest value is tied (the first index wins, as argmax), and a
    vocabulary that is not a multiple of the tile. No draw leaves the reference's kept set."""
    rng = np.random.default_rng(11)
    rows, vocab = 64, 3000
    logits = (rng.normal(size=(rows, vocab)) * rng.uniform(0.5, 4, size=(rows, 1))).astype(np.float32)
    logits[1::8] = np.round(logits[1::8])  # many ties
    logits[2::8, [5, 900, 2999]] = 50.0  # a tied maximum
    temp = np.where(np.arange(rows) % 4 == 2, 0.0, rng.uniform(0.5, 1.5, rows)).astype(np.float32)
    k = rng.choice([0, 1, 7, 300, 2999, 5000], rows).astype(np.int32)
    p = rng.choice([1.0, 0.5, 0.9, 0.99], rows).astype(np.float32)
    keys = jax.random.split(jax.random.PRNGKey(2), rows)
    tok = np.asarray(top_k_top_p_sampling(jnp.asarray(logits), keys, jnp.asarray(temp), jnp.asarray(k),
                                          jnp.asarray(p), tile=64, row_splits=row_splits, interpret=True))
    scaled = logits / np.where(temp > 0, temp, 1.0)[:, None]
    kept = np.asarray(top_k_top_p_mask(jnp.asarray(scaled), jnp.asarray(k), jnp.asarray(p))) > -np.inf
    greedy = temp <= 0
    np.testing.assert_array_equal(tok[greedy], logits[greedy].argmax(axis=1))
    assert kept[np.arange(rows), tok].all()
    assert len(set(tok[~greedy & (k == 0) & (p == 1.0)])) > 1  # (sampled rows do sample)


@pytest.mark.parametrize("row_splits", [1, 2])
def test_top_k_largest_sharing_a_lane(row_splits):
    """The k-th largest lane max only bounds the k-th largest logit when two of the k largest share a lane (tokens
    j, j + tile, ...): here the three largest are all in lane 0, so the bound (lane 1's max) keeps 4 tokens and
    the search must go on to the true 2nd largest. Top-p 0.95 then keeps both of the top 2 (top-k cuts the
    3rd); top-p 0.5 only the first, where a top-k mass taken over the bound's 4 tokens would keep the second."""
    logits = (np.random.default_rng(4).normal(size=200) * 0.5).astype(np.float32)
    logits[[0, 32, 64, 1]] = [5.0, 4.9, 4.8, 3.0]
    for p, kept in ((0.95, {0, 32}), (0.5, {0})):
        want = filtered_probs(logits, 1.0, 2, p)
        assert set(np.flatnonzero(want)) == kept
        assert_draws_follow(draw(np.tile(logits, (N, 1)), 1.0, 2, p, tile=32, row_splits=row_splits), want)


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="top_p"):
        top_k_top_p_sampling(jnp.zeros((2, 5)), jax.random.PRNGKey(0), jnp.ones(2), jnp.zeros(2, jnp.int32),
                             jnp.ones(3))
    with pytest.raises(ValueError, match="row_splits"):
        top_k_top_p_sampling(jnp.zeros((2, 5)), jax.random.PRNGKey(0), jnp.ones(2), jnp.zeros(2, jnp.int32),
                             jnp.ones(2), row_splits=3)
    with pytest.raises(ValueError, match="tile"):
        top_k_top_p_sampling(jnp.zeros((2, 5)), jax.random.PRNGKey(0), jnp.ones(2), jnp.zeros(2, jnp.int32),
                             jnp.ones(2), tile=48)


@pytest.mark.parametrize("vocab", [49_152, 128_256])
@pytest.mark.parametrize("row_splits", [1, 4])
def test_kernel_lowers_for_cuda(vocab, row_splits):
    spec = jax.ShapeDtypeStruct
    args = (spec((64, vocab), jnp.float32), spec((64, 2), jnp.uint32), spec((64,), jnp.float32),
            spec((64,), jnp.int32), spec((64,), jnp.float32))
    text = lower_for_cuda(lambda *a: top_k_top_p_sampling(*a, row_splits=row_splits), *args)
    assert "triton" in text.lower()
    assert ("top_k_top_p_first_pass_4_parts" in text) == (row_splits == 4)

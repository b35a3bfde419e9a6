"""The reference top-k/top-p sampler draws from exactly the filtered distribution."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.sampling import reference_top_k_top_p_sampling

N = 20_000


def filtered_probs(logits, temperature, k, p):
    """The distribution vLLM means: temperature, top-k, then top-p over the renormalized rest."""
    x = logits / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros_like(x, bool)
    kk = len(x) if k <= 0 else min(k, len(x))
    probs = np.exp(x[order[:kk]] - x[order[0]])
    probs /= probs.sum()
    before = np.cumsum(probs) - probs
    chosen = order[:kk][before < p]
    keep[chosen] = True
    out = np.where(keep, np.exp(x - x.max()), 0)
    return out / out.sum()


def assert_draws_follow(draws, probs) -> None:
    """The draws come from `probs`: none outside its support, and two goodness-of-fit tests.

    Pearson's chi-square over the kept tokens (bins expecting < 5 draws pooled) against its 1 - 3e-7 quantile
    (Wilson-Hilferty, z = 5), and the largest per-token z-score against 5.5 (Bonferroni over <= 200 tokens:
    < 1e-6). Simulated with the settings below (200 multinomial samples of 20k draws each): no false failure;
    2% of the mass moved from the most likely token to the second is caught in >= 90% of samples, a kept
    token with >= 2% of the mass never drawn always (z >= 20). The old total-variation bound missed most of them.
    """
    n = len(draws)
    counts = np.bincount(draws, minlength=len(probs))
    assert counts[probs == 0].sum() == 0, "drew a token outside the kept set"
    expected = probs * n
    big = expected >= 5
    obs, exp = np.append(counts[big], counts[~big].sum()), np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:
        obs, exp = obs[:-1], exp[:-1]
    dof = len(exp) - 1
    if dof == 0:
        return
    chi2 = ((obs - exp) ** 2 / exp).sum()
    assert chi2 < dof * (1 - 2 / (9 * dof) + 5 * np.sqrt(2 / (9 * dof))) ** 3, f"chi-square {chi2:.0f}, {dof} dof"
    z = np.abs(obs - exp) / np.sqrt(exp * (1 - exp / n) + 1e-12)
    assert z.max() < 5.5, f"token z-score {z.max():.1f}"


@pytest.mark.parametrize("temperature,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.7),
                                             (1.0, 1, 1.0), (1.0, 0, 1e-6), (1.0, 100, 1.0)])
def test_draws_follow_the_filtered_distribution(temperature, k, p):
    v = 24
    logits = np.random.default_rng(3).normal(size=v).astype(np.float32) * 2
    want = filtered_probs(logits, temperature, k, p)
    tok = reference_top_k_top_p_sampling(jnp.tile(logits, (N, 1)), jax.random.PRNGKey(7), jnp.full(N, temperature),
                                         jnp.full(N, k, jnp.int32), jnp.full(N, p, jnp.float32))
    assert_draws_follow(np.asarray(tok), want)


def test_mixed_rows_greedy_and_seeded_determinism():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)), jnp.float32)
    temp = jnp.array([0.0, 1.0, 1.0, 0.0])
    k, p = jnp.array([0, 3, 0, 5], jnp.int32), jnp.array([1.0, 1.0, 0.5, 0.1], jnp.float32)
    keys = jax.random.split(jax.random.PRNGKey(1), 4)
    a = reference_top_k_top_p_sampling(logits, keys, temp, k, p)
    b = reference_top_k_top_p_sampling(logits, keys, temp, k, p)
    assert (np.asarray(a) == np.asarray(b)).all()
    assert a[0] == jnp.argmax(logits[0]) and a[3] == jnp.argmax(logits[3])
    assert int(a[1]) in set(np.argsort(-np.asarray(logits[1]))[:3].tolist())


def test_bad_shapes_raise():
    with pytest.raises(ValueError, match="top_k"):
        reference_top_k_top_p_sampling(jnp.zeros((2, 5)), jax.random.PRNGKey(0), jnp.ones(2),
                                       jnp.zeros(3, jnp.int32), jnp.ones(2))


def test_first_argmax_is_argmax_with_ties_and_masked_rows():
    from pallas_kernels.sampling import first_argmax

    rng = np.random.default_rng(0)
    x = rng.integers(-3, 4, size=(64, 300)).astype(np.float32)  # many ties: the first index must win
    x[5] = -np.inf  # every token banned
    x[6, :] = -np.inf
    x[6, 299] = 1.0  # the last token only
    np.testing.assert_array_equal(np.asarray(first_argmax(jnp.asarray(x))), np.argmax(x, axis=-1))

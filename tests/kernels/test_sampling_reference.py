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


@pytest.mark.parametrize("temperature,k,p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.7),
                                             (1.0, 1, 1.0), (1.0, 0, 1e-6), (1.0, 100, 1.0)])
def test_draws_follow_the_filtered_distribution(temperature, k, p):
    v = 24
    logits = np.random.default_rng(3).normal(size=v).astype(np.float32) * 2
    want = filtered_probs(logits, temperature, k, p)
    tok = reference_top_k_top_p_sampling(jnp.tile(logits, (N, 1)), jax.random.PRNGKey(7), jnp.full(N, temperature),
                                         jnp.full(N, k, jnp.int32), jnp.full(N, p, jnp.float32))
    got = np.bincount(np.asarray(tok), minlength=v) / N
    assert got[want == 0].sum() == 0  # nothing outside the kept set, ever
    # Total variation of N=20k draws: its sd is below sqrt(v / N) / 2 ~ 0.017; 0.04 is > 2 sd.
    assert 0.5 * np.abs(got - want).sum() < 0.04


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

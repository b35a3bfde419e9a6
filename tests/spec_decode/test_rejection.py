"""Rejection sampling of drafts (`verify_drafts`) against the distribution the sampler draws from."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from scipy import stats

from jaxpaged.layers.logits_processors import ProcessorInputs
from jaxpaged.layers.sampler import SamplingMetadata
from jaxpaged.spec_decode import rejection
from jaxpaged.spec_decode.rejection import target_logits

V = 8
LOGITS = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0], np.float32)


def meta(s: int, *, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, steps=5):
    f = lambda v, dt: jnp.full(s, v, dt)  # noqa: E731
    z = jnp.zeros(s, jnp.int32)
    return SamplingMetadata(
        temperature=f(temperature, jnp.float32), top_k=f(top_k, jnp.int32), top_p=f(top_p, jnp.float32),
        seeds=jnp.arange(s, dtype=jnp.uint32), steps=f(steps, jnp.int32), num_logprobs=f(-1, jnp.int32),
        processors=ProcessorInputs(token_slot=z, token_is_output=jnp.zeros(s, bool), reset_slots=jnp.zeros(s, bool),
                                   row_slot=z, repetition_penalty=f(1.0, jnp.float32),
                                   presence_penalty=f(0.0, jnp.float32), frequency_penalty=f(0.0, jnp.float32),
                                   min_p=f(min_p, jnp.float32), use_bias=jnp.zeros(s, bool),
                                   suppress_stop=jnp.zeros(s, bool)))


def verify_drafts(logits, drafts, bonus, m):
    """`rejection.verify_drafts` on a [S, K] grid of drafts, laid out flat as the step does."""
    s, k = drafts.shape
    return rejection.verify_drafts(jnp.reshape(logits, (s * k, -1)), jnp.reshape(drafts, -1),
                                   jnp.repeat(jnp.arange(s), k), jnp.tile(jnp.arange(k), s), bonus, m, k)


def target_probs(**kw) -> np.ndarray:
    m = meta(1, **kw)
    x = target_logits(jnp.asarray(LOGITS)[None], m.temperature, m.top_k, m.top_p, m.processors.min_p)
    p = np.asarray(jax.nn.softmax(x, axis=-1), np.float64)[0]
    return p / p.sum()


@pytest.mark.parametrize("draft", [0, 3, 7])
@pytest.mark.parametrize("settings", [dict(temperature=1.0), dict(temperature=0.7, top_k=5),
                                      dict(temperature=1.3, top_p=0.8), dict(temperature=1.0, min_p=0.1)],
                         ids=["plain", "top_k", "top_p", "min_p"])
def test_first_emitted_token_follows_the_target_distribution(draft, settings):
    """Chi-square: whatever the draft (likely, unlikely, outside the kept set), the first emitted token is
    distributed as the sampler's target distribution."""
    s = 20_000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (s, 1, V))
    emitted, count = verify_drafts(logits, jnp.full((s, 1), draft, jnp.int32), jnp.full(s, -7, jnp.int32),
                                   meta(s, **settings))
    first = np.asarray(emitted[:, 0])
    p = target_probs(**settings)
    assert ((first >= 0) & (first < V)).all()
    observed = np.bincount(first, minlength=V)
    assert observed[p == 0].sum() == 0  # never a token outside the kept set
    kept = p > 0
    _, pvalue = stats.chisquare(observed[kept], s * p[kept])
    assert pvalue > 1e-3, (observed, s * p)
    # accepted (count 2: the bonus, -7 here, follows) exactly as often as p(draft)
    accepted = np.asarray(count) == 2
    assert (first[accepted] == draft).all() and (np.asarray(emitted[accepted, 1]) == -7).all()


def test_greedy_rows_accept_the_argmax_prefix():
    logits = np.full((3, 3, V), -1.0, np.float32)
    logits[:, 0, 2] = logits[:, 1, 5] = logits[:, 2, 1] = 4.0  # argmax 2, then 5, then 1
    drafts = np.array([[2, 5, 1], [2, 4, 1], [6, -1, -1]], np.int32)
    emitted, count = verify_drafts(jnp.asarray(logits), jnp.asarray(drafts), jnp.array([9, 9, 9]),
                                   meta(3, temperature=0.0))
    assert np.asarray(count).tolist() == [4, 2, 1]
    assert np.asarray(emitted).tolist() == [[2, 5, 1, 9], [2, 5, -1, -1], [2, -1, -1, -1]]


def test_later_positions_are_conditioned_on_acceptance():
    """The second draft is only judged when the first was accepted; its emitted token follows p as well."""
    s = 20_000
    logits = jnp.broadcast_to(jnp.asarray(LOGITS), (s, 2, V))
    emitted, count = verify_drafts(logits, jnp.full((s, 2), 1, jnp.int32), jnp.full(s, -7, jnp.int32), meta(s))
    emitted, count = np.asarray(emitted), np.asarray(count)
    p = target_probs()
    second = emitted[count >= 2, 1]
    _, pvalue = stats.chisquare(np.bincount(second, minlength=V), len(second) * p)
    assert pvalue > 1e-3
    assert abs((count == 3).mean() - p[1] ** 2) < 0.01

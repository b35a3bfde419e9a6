"""Each logits processor against a numpy reference, and against HF transformers' processors."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
)

from jaxpaged.layers.logits_processors import ProcessorInputs, RowState, apply_min_p, process_logits, update_row_state

S, V, R = 3, 40, 4


def inputs(rows, **kw):
    s = len(rows)
    base = dict(token_slot=jnp.zeros(1, jnp.int32), token_is_output=jnp.zeros(1, bool), reset_slots=jnp.zeros(R, bool),
                row_slot=jnp.asarray(rows, jnp.int32), repetition_penalty=jnp.ones(s), presence_penalty=jnp.zeros(s),
                frequency_penalty=jnp.zeros(s), min_p=jnp.zeros(s), use_bias=jnp.zeros(s, bool),
                suppress_stop=jnp.zeros(s, bool))
    base.update({k: jnp.asarray(v) for k, v in kw.items()})
    return ProcessorInputs(**base)


def fed_state(prompts, outputs):
    """RowState after feeding each slot's prompt and output tokens through update_row_state."""
    toks, slots, is_out = [], [], []
    for slot, (p, o) in enumerate(zip(prompts, outputs)):
        toks += p + o
        slots += [slot] * (len(p) + len(o))
        is_out += [False] * len(p) + [True] * len(o)
    p = inputs([0], token_slot=np.array(slots + [R], np.int32), token_is_output=np.array(is_out + [False]),
               reset_slots=np.ones(R, bool))
    return update_row_state(RowState.zeros(R, V), p, jnp.asarray(toks + [0], jnp.int32))


def numpy_penalties(logits, prompt, output, rep, pres, freq):
    out = logits.copy()
    counts = np.bincount(output, minlength=V)
    seen = (np.bincount(prompt, minlength=V) > 0) | (counts > 0)
    out = np.where(seen, np.where(out > 0, out / rep, out * rep), out)
    return out - freq * counts - pres * (counts > 0)


def test_penalties_match_numpy():
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(S, V)).astype(np.float32) * 3
    prompts = [[1, 2, 3], [4, 4], [5]]
    outputs = [[2, 7, 7, 7], [], [9, 5]]
    rep, pres, freq = np.array([1.3, 1.0, 0.7]), np.array([0.5, -1.0, 0.0]), np.array([0.2, 0.0, -0.4])
    state = fed_state(prompts + [[]], outputs + [[]])
    got = process_logits(jnp.asarray(logits), state, inputs([0, 1, 2], repetition_penalty=rep.astype(np.float32),
                                                            presence_penalty=pres.astype(np.float32),
                                                            frequency_penalty=freq.astype(np.float32)))
    for i in range(S):
        want = numpy_penalties(logits[i], np.array(prompts[i], int), np.array(outputs[i], int), rep[i], pres[i],
                               freq[i])
        np.testing.assert_allclose(np.asarray(got[i]), want, rtol=1e-6, atol=1e-6)


def test_repetition_penalty_matches_hf():
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(1, V)).astype(np.float32)
    history = [3, 8, 8, 15, 22]  # prompt [3, 8], output [8, 15, 22]
    state = fed_state([history[:2]], [history[2:]])
    got = process_logits(jnp.asarray(logits), state, inputs([0], repetition_penalty=np.array([1.5], np.float32)))
    want = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([history]), torch.tensor(logits)).numpy()
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-6)


def test_min_p_matches_hf():
    rng = np.random.default_rng(2)
    logits = rng.normal(size=(2, V)).astype(np.float32) * 2
    got = np.asarray(apply_min_p(jnp.asarray(logits), jnp.array([0.1, 0.1])))
    want = MinPLogitsWarper(0.1)(None, torch.tensor(logits)).numpy()
    assert ((got == -np.inf) == (want == -np.inf)).all()
    np.testing.assert_array_equal(got[got > -np.inf], logits[got > -np.inf])


def test_min_tokens_matches_hf():
    logits = np.random.default_rng(3).normal(size=(1, V)).astype(np.float32)
    state = RowState.zeros(R, V)
    mask = np.zeros((R, V), bool)
    mask[0, [2, 11]] = True  # EOS and a stop token id
    state = RowState(state.output_counts, state.prompt_seen, state.bias, jnp.asarray(mask))
    got = process_logits(jnp.asarray(logits), state, inputs([0], suppress_stop=np.array([True])))
    hf = MinNewTokensLengthLogitsProcessor(prompt_length_to_skip=2, min_new_tokens=3, eos_token_id=[2, 11])
    want = hf(torch.tensor([[5, 6, 7]]), torch.tensor(logits)).numpy()  # one new token so far: suppressed
    np.testing.assert_array_equal(np.asarray(got), want)


def test_bias_rows_and_rows_without_features_untouched():
    logits = np.random.default_rng(4).normal(size=(2, V)).astype(np.float32)
    bias = np.zeros((R, V), np.float32)
    bias[1, 5] = 3.0
    bias[1, 6] = -np.inf
    st = RowState.zeros(R, V)
    st = RowState(st.output_counts, st.prompt_seen, jnp.asarray(bias), st.min_tokens_mask)
    got = np.asarray(process_logits(jnp.asarray(logits), st, inputs([1, 1], use_bias=np.array([True, False]))))
    assert got[0, 5] == pytest.approx(logits[0, 5] + 3) and got[0, 6] == -np.inf
    np.testing.assert_array_equal(got[1], logits[1])


def test_reset_clears_a_reused_slot():
    state = fed_state([[1, 2]], [[3, 3]])
    assert int(state.output_counts[0, 3]) == 2
    p = inputs([0], token_slot=np.array([0], np.int32), token_is_output=np.array([False]),
               reset_slots=np.array([True, False, False, False]))
    state = update_row_state(state, p, jnp.array([9], jnp.int32))
    assert int(state.output_counts[0].sum()) == 0
    assert bool(state.prompt_seen[0, 9]) and not bool(state.prompt_seen[0, 1])

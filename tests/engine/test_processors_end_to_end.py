"""Logits processors through the whole engine, against an independent numpy reference over HF's logits.

Batches mix the features, and max_num_seqs=2 makes every request reuse the processor-state slot of one
before it, so penalty state that survives a slot's reuse, a dropped bad word, an EOS that min_tokens fails
to hold back, or a penalty that ignores a request shows up as a different greedy token.
"""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.reference import hf_last_logits
from tests.tiny_models import load_hf_model

EOS = 2
PROMPTS = [[5, 9, 14, 9, 30, 41], [100, 101, 102], [7, 7, 7, 8], [60, 61, 62, 63, 64, 65, 66]]


def reference_greedy(hf, prompt: list[int], max_tokens: int, *, rep=1.0, pres=0.0, freq=0.0, bias=None,
                     banned=(), min_tokens=0, ignore_eos=True) -> list[int]:
    """vLLM's processors in numpy on HF's float32 logits: bias, min_tokens, penalties; greedy."""
    out: list[int] = []
    for _ in range(max_tokens):
        x = hf_last_logits(hf, prompt + out).astype(np.float64)
        for t, b in (bias or {}).items():
            x[t] += b
        x[list(banned)] = -np.inf
        if len(out) < min_tokens:
            x[EOS] = -np.inf
        counts = np.bincount(out, minlength=x.size)
        seen = (np.bincount(prompt, minlength=x.size) > 0) | (counts > 0)
        x = np.where(seen, np.where(x > 0, x / rep, x * rep), x) - freq * counts - pres * (counts > 0)
        tok = int(np.argmax(x))
        out.append(tok)
        if tok == EOS and not ignore_eos:
            break
    return out


@pytest.fixture(scope="module")
def hf(tiny_model_dir):
    return load_hf_model(tiny_model_dir("llama"))


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), num_kv_blocks=64, max_num_seqs=2, max_num_batched_tokens=64,
               compile_guard=True)


def test_penalties_bias_and_plain_rows_in_one_batch_reusing_slots(llm, hf):
    cases = [
        dict(rep=1.6, freq=0.4),  # penalized: its counts must not leak into the next user of its slot
        dict(),
        dict(pres=1.5),
        dict(freq=1.2, bias={77: 3.0}),
        dict(),  # plain again, after penalized rows in both slots
        dict(rep=0.7, pres=-0.5),
    ]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(cases))]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=c.get("rep", 1.0),
                             presence_penalty=c.get("pres", 0.0), frequency_penalty=c.get("freq", 0.0),
                             logit_bias=c.get("bias")) for c in cases]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for i, (p, c, out) in enumerate(zip(prompts, cases, outs)):
        assert out.outputs[0].token_ids == reference_greedy(hf, p, 10, **c), f"case {i}: {c}"


def test_bad_words_are_never_generated(llm, hf):
    tok = llm.get_tokenizer()
    base = reference_greedy(hf, PROMPTS[0], 8)
    banned_words = [tok.decode([base[0]]), tok.decode([base[2]])]  # the first and third greedy words
    banned = [base[0], base[2]]
    out = llm.generate([PROMPTS[0], PROMPTS[1]], [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                                 bad_words=banned_words),
                                                  SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)],
                       use_tqdm=False)
    assert out[0].outputs[0].token_ids == reference_greedy(hf, PROMPTS[0], 8, banned=banned)
    assert not set(banned) & set(out[0].outputs[0].token_ids)
    assert out[1].outputs[0].token_ids == reference_greedy(hf, PROMPTS[1], 8)  # its neighbour is untouched


def test_min_tokens_holds_back_eos(llm, hf):
    """EOS is forced by a bias; min_tokens=3 must hold it back for three tokens, then it ends the request."""
    forced = {EOS: 100.0}
    plain = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, logit_bias=forced),
                         use_tqdm=False)[0].outputs[0]
    assert plain.token_ids == [EOS] and plain.finish_reason == "stop"
    held = llm.generate([PROMPTS[2]], SamplingParams(temperature=0, max_tokens=8, logit_bias=forced, min_tokens=3),
                        use_tqdm=False)[0].outputs[0]
    want = reference_greedy(hf, PROMPTS[2], 8, bias=forced, min_tokens=3, ignore_eos=False)
    assert held.token_ids == want and len(want) == 4 and want[-1] == EOS and held.finish_reason == "stop"


def test_logit_bias_outweighs_penalties(llm):
    out = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                    logit_bias={77: 100.0}, frequency_penalty=2.0,
                                                    presence_penalty=2.0, repetition_penalty=2.0),
                       use_tqdm=False)[0].outputs[0]
    assert out.token_ids == [77] * 6


def test_min_p_draws_only_tokens_above_the_threshold(llm, hf):
    """Sampled with min_p=0.3 at temperature 1: every token drawn has probability >= 0.3 x the top token's."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    outs = llm.generate(prompts, SamplingParams(temperature=1.0, min_p=0.3, max_tokens=6, ignore_eos=True, seed=11),
                        use_tqdm=False)
    below = 0.0  # the probability mass min_p removes, summed over the draws: a sampler ignoring min_p lands there
    for p, out in zip(prompts, outs):
        toks = out.outputs[0].token_ids
        for j, t in enumerate(toks):
            x = hf_last_logits(hf, p + toks[:j]).astype(np.float64)
            prob = np.exp(x - x.max())
            assert prob[t] >= 0.3 - 1e-6, f"drew a token at {prob[t]:.3f} of the top probability"
            below += prob[prob < 0.3].sum() / prob.sum()
    assert below > 5, "min_p removed too little mass for the test to tell a sampler that ignores it"

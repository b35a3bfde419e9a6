"""n-gram speculative decoding through the engine, on a tiny random-weight model: the same greedy tokens (and
logprobs, stops, finish reasons) as without it, drafts really verified and accepted, and sampled tokens
distributed as without it."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from tests.spec_decode.same_distribution import assert_same_distribution

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1,
        "adaptive": False}  # every draft verified (the draft budget is tested on its own)
ENGINE = dict(max_num_batched_tokens=128, num_kv_blocks=256, compile_guard=True)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts that repeat a short random phrase (what n-gram lookup feeds on), of varied lengths."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        phrase = rng.integers(3, 256, rng.integers(2, 6)).tolist()
        out.append((rng.integers(3, 256, rng.integers(0, 8)).tolist() + phrase * int(rng.integers(2, 6))))
    return out


@pytest.fixture(scope="module")
def plain(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), **ENGINE)


@pytest.fixture(scope="module")
def spec(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), speculative_config=SPEC, async_scheduling=True, **ENGINE)


def tokens(llm, ps, params):
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in ps], params,
                                                          use_tqdm=False)]


def test_async_scheduling_steps_synchronously_with_speculation(spec):
    assert spec.engine.core.async_scheduling is False


def test_greedy_tokens_identical_and_drafts_accepted(plain, spec):
    ps = prompts(24)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    before = spec.engine.stats.spec_num_accepted_tokens
    assert tokens(spec, ps, params) == tokens(plain, ps, params)
    stats_ = spec.engine.stats
    assert stats_.spec_num_accepted_tokens - before > 20  # drafts were verified, and some accepted (random weights)
    assert stats_.mean_acceptance_length > 1.05
    metrics = spec.engine.metrics.render().decode()
    assert "jaxpaged:spec_decode_num_accepted_tokens_total" in metrics
    assert 'jaxpaged:spec_decode_num_accepted_tokens_per_pos_total{position="0"}' in metrics


def test_logprobs_of_accepted_tokens(plain, spec):
    ps = prompts(6, seed=1)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=3)
    a = plain.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    b = spec.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert len(y.outputs[0].logprobs) == len(y.outputs[0].token_ids)
        for lx, ly in zip(x.outputs[0].logprobs, y.outputs[0].logprobs):
            assert list(lx) == list(ly)  # the same top ids (and the drawn token) in the same order
            for t in lx:
                assert ly[t].logprob == pytest.approx(lx[t].logprob, abs=1e-4)
                assert ly[t].rank == lx[t].rank


def test_stops_inside_drafts_end_where_they_would(plain, spec):
    """max_tokens, stop token ids and stop strings that land inside an accepted draft."""
    ps = prompts(8, seed=2)
    free = tokens(plain, ps, SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    cases = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (1, 2, 3, 5, 7, 9, 11, 13)]
    cases += [SamplingParams(temperature=0, max_tokens=30, stop_token_ids=[out[k]], ignore_eos=True)
              for out, k in zip(free, (3, 5, 6, 9, 12, 2, 7, 10))]
    cases += [SamplingParams(temperature=0, max_tokens=30, stop=[f"w{out[k] - 3}"], ignore_eos=True)
              for out, k in zip(free, (4, 6, 8, 11, 3, 5, 9, 14))]
    inputs = [{"prompt_token_ids": p} for p in ps * 3]
    a = plain.generate(inputs, cases, use_tqdm=False)
    b = spec.generate(inputs, cases, use_tqdm=False)
    for x, y in zip(a, b):
        ox, oy = x.outputs[0], y.outputs[0]
        assert (oy.token_ids, oy.text, oy.finish_reason, oy.stop_reason) == (ox.token_ids, ox.text,
                                                                             ox.finish_reason, ox.stop_reason)


def test_requests_with_penalties_do_not_speculate_and_stay_exact(plain, spec):
    ps = prompts(8, seed=3)
    cases = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.3 if i % 2 else 1.0)
             for i in range(len(ps))]
    assert tokens(spec, ps, cases) == tokens(plain, ps, cases)


def test_preemption_with_speculation(tiny_model_dir):
    """A pool too small for the batch: requests are preempted (their drafts and rollbacks with them) and
    recomputed; the greedy tokens stay those of the plain engine."""
    small = dict(ENGINE, num_kv_blocks=24, async_scheduling=False)
    ps = prompts(16, seed=4)
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    spec = LLM(tiny_model_dir("llama"), speculative_config=SPEC, **small)
    got = tokens(spec, ps, params)
    assert spec.engine.scheduler.num_preemptions > 0 and spec.engine.stats.spec_num_accepted_tokens > 0
    del spec
    assert got == tokens(LLM(tiny_model_dir("llama"), **small), ps, params)


def test_sampled_tokens_follow_the_same_distribution(plain, spec):
    """Seeded samples at temperature 0.8 with and without speculation: the tokens at each output position have the
    same distribution (chi-square on a contingency table, rare tokens pooled)."""
    base = [17, 42, 99, 5, 61]
    greedy = tokens(plain, [base], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    prompt = {"prompt_token_ids": base + greedy + base}  # n-gram lookup drafts the greedy continuation
    n = 1500
    params = [SamplingParams(temperature=0.8, top_k=3, max_tokens=4, ignore_eos=True, seed=s) for s in range(n)]
    drafts = spec.engine.stats.spec_num_draft_tokens
    a = np.array([o.outputs[0].token_ids for o in plain.generate([prompt] * n, params, use_tqdm=False)])
    b = np.array([o.outputs[0].token_ids for o in spec.generate([prompt] * n, params, use_tqdm=False)])
    assert spec.engine.stats.spec_num_draft_tokens - drafts > n  # positions 1-3 were mostly verified drafts
    assert_same_distribution(a, b, range(1, 4))

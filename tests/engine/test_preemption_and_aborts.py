"""Schedules at the edges: swap of prefix-cache hits, penalized requests under pressure, aborts mid-prefill and
before n > 1 siblings fork, n > 1 with processors. Outputs equal the unpressured run; every block comes back."""

from __future__ import annotations

import numpy as np
import pytest

from jaxpaged import LLM, LLMEngine, SamplingParams
from jaxpaged.engine.arg_utils import EngineArgs

SHARED = np.random.default_rng(3).integers(3, 256, size=40).tolist()


def batch() -> list[list[int]]:
    rng = np.random.default_rng(4)
    return [SHARED + rng.integers(3, 256, size=n).tolist() for n in (3, 9, 17, 30)]


def whole(kv) -> bool:
    return kv.num_free_blocks == kv.pool.num_blocks - 1 and len(kv.host_free) == kv.num_host_blocks


@pytest.fixture(scope="module")
def roomy(tiny_model_dir):
    return LLM(tiny_model_dir("llama"), num_kv_blocks=64, max_num_batched_tokens=64, compile_guard=True)


def test_swap_preemption_of_prefix_cache_hits(tiny_model_dir, roomy):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in roomy.generate(batch(), params, use_tqdm=False)]
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=12, max_num_batched_tokens=64, compile_guard=True,
              preemption_mode="swap", swap_space=1e-3)
    llm.generate([SHARED + [5]], params, use_tqdm=False)  # fills the prefix cache
    got = [o.outputs[0].token_ids for o in llm.generate(batch(), params, use_tqdm=False)]
    kv, sched = llm.engine.kv_cache_manager, llm.engine.scheduler
    assert kv.num_hit_tokens >= 4 * 32 and sched.num_swaps > 0
    assert got == want and whole(kv)


def test_penalized_requests_fall_back_to_recompute(tiny_model_dir, roomy):
    """Penalty counts are rebuilt from the tokens a step is fed, so a swapped-out request would lose them:
    under pressure in swap mode, penalized requests recompute, plain ones swap; outputs are unchanged."""
    prompts = batch()
    params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True,
                             **({"frequency_penalty": 1.0, "repetition_penalty": 1.3} if i % 2 else {}))
              for i in range(len(prompts))]
    want = [o.outputs[0].token_ids for o in roomy.generate(prompts, params, use_tqdm=False)]
    llm = LLM(tiny_model_dir("llama"), num_kv_blocks=8, max_num_batched_tokens=64, compile_guard=True,
              preemption_mode="swap", swap_space=1e-3, enable_prefix_caching=False)
    preempted: list[bool] = []  # penalized?
    swapped: list[bool] = []
    sched, kv = llm.engine.scheduler, llm.engine.kv_cache_manager
    real_preempt, real_swap_out = sched._preempt, kv.swap_out

    def spy_preempt(request, out, **kw):
        preempted.append(request.sampling_params.needs_penalties)
        return real_preempt(request, out, **kw)

    def spy_swap_out(request):
        swapped.append(request.sampling_params.needs_penalties)
        return real_swap_out(request)
    sched._preempt, kv.swap_out = spy_preempt, spy_swap_out
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert True in preempted and False in swapped and True not in swapped  # penalized: recomputed, never swapped
    assert whole(kv)


@pytest.fixture
def engine(tiny_model_dir):
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), num_kv_blocks=64,
                                                 max_num_batched_tokens=16, compile_guard=True))


def run(engine) -> dict[str, list[int]]:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [o.token_ids for o in out.outputs]
    return done


def test_abort_during_a_chunked_prefill(engine):
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    engine.add_request("long", SHARED * 2, params)  # 80 tokens: five steps of 16
    engine.add_request("other", [5, 6, 7], params)
    engine.step()
    engine.step()
    req = engine.scheduler.requests["long"]
    assert 0 < req.num_computed_tokens < 80 and not req.output_token_ids
    engine.abort_request("long")
    assert "long" not in engine.scheduler.requests
    done = run(engine)
    assert list(done) == ["other"] and len(done["other"][0]) == 6
    assert whole(engine.kv_cache_manager)


@pytest.mark.parametrize("steps_before_abort", [0, 2])
def test_abort_n_before_the_siblings_fork(engine, steps_before_abort):
    engine.add_request("n3", SHARED, SamplingParams(n=3, temperature=1.0, max_tokens=6, ignore_eos=True))
    for _ in range(steps_before_abort):  # the prompt (40 tokens) takes three steps: still no fork
        assert engine.step() == []
    assert list(engine.scheduler.requests) == ["n3#0"]  # the siblings join only when they fork
    engine.abort_request("n3")
    assert not engine.has_unfinished_requests() and engine.get_num_unfinished_requests() == 0
    assert engine.step() == [] and whole(engine.kv_cache_manager)
    engine.add_request("after", [5, 6], SamplingParams(max_tokens=2, ignore_eos=True))
    assert list(run(engine)) == ["after"]


def test_n_greater_than_one_with_processors(roomy):
    """Greedy n=3 with penalties, a bias and min_tokens: every sample equals the n=1 result (penalized samples
    prefill on their own; the others fork)."""
    prompt = batch()[1]
    for kw in (dict(frequency_penalty=0.8, repetition_penalty=1.4), dict(logit_bias={77: 4.0}),
               dict(min_tokens=5, logit_bias={2: 6.0})):
        one = roomy.generate([prompt], SamplingParams(temperature=0, max_tokens=8, **kw), use_tqdm=False)[0]
        three = roomy.generate([prompt], SamplingParams(n=3, temperature=0, max_tokens=8, **kw), use_tqdm=False)[0]
        assert [o.token_ids for o in three.outputs] == [one.outputs[0].token_ids] * 3, kw
        assert [o.index for o in three.outputs] == [0, 1, 2]
    assert whole(roomy.engine.kv_cache_manager)

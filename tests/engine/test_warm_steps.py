"""A server's engine runs and times each step bucket before its first request; those runs change no output, and
prompt chunks planned with the times neither."""

import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams
from jaxpaged.core.sched.scheduler import Scheduler
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.async_llm import AsyncLLM
from jaxpaged.runner.model_runner import ModelRunner
from tests.reference import hf_greedy
from tests.tiny_models import load_hf_model

ARGS = {"max_num_batched_tokens": 64, "num_kv_blocks": 64}


def prompts() -> list[list[int]]:
    rng = np.random.default_rng(2)
    return [rng.integers(3, 256, size=n).tolist() for n in (5, 17, 40, 63)]


@pytest.mark.parametrize("dp", [1, 2])
def test_async_engine_runs_every_bucket_before_serving(tiny_model_dir, monkeypatch, dp):
    ran: list[tuple[int, int]] = []
    run_step = ModelRunner.run_step

    def recording(self, t, *args):
        ran.append((id(self), t))
        return run_step(self, t, *args)

    monkeypatch.setattr(ModelRunner, "run_step", recording)
    timed: list[tuple[int, list[int]]] = []
    set_costs = Scheduler.set_step_costs
    monkeypatch.setattr(Scheduler, "set_step_costs", lambda self, seconds, by_tokens=False: timed.append(
        (id(self), sorted(seconds))) or set_costs(self, seconds, by_tokens))
    llm = AsyncLLM.from_engine_args(EngineArgs(model=tiny_model_dir("llama"), data_parallel_size=dp, **ARGS))
    try:
        runners = [core.runner for core in llm.engine.core.replicas]
        # each replica's every bucket, once to warm it and twice timed, before any request
        assert sorted(ran) == sorted((id(r), t) for r in runners for t in r.buckets for _ in range(3))
        for core in llm.engine.core.replicas:
            assert core.kv_cache_manager.num_free_blocks == 63  # the runs took no block
            assert (id(core.scheduler), core.runner.buckets) in timed  # its scheduler got every bucket's time
    finally:
        llm.shutdown()


def test_warm_runs_change_no_output(tiny_model_dir):
    path = tiny_model_dir("llama")
    hf = load_hf_model(path)
    expected = [hf_greedy(hf, p, 12) for p in prompts()]
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=12, ignore_eos=True, seed=7,
                             repetition_penalty=1.2)
    outs = []
    for warm in (False, True):
        llm = LLM(path, compile_guard=True, **ARGS)
        if warm:
            assert llm.engine.warm_steps() > 0
            llm.engine.core.scheduler.set_step_costs(None)  # (chunks planned on measured times vary run to run)
        got = llm.generate(prompts(), greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in got] == expected
        outs.append([o.outputs[0].token_ids for o in llm.generate(prompts(), sampled, use_tqdm=False)])
        assert llm.engine.kv_cache_manager.num_free_blocks == 63
    assert outs[0] == outs[1]


def test_prompt_chunks_planned_with_step_costs_change_no_output(tiny_model_dir, monkeypatch):
    """Step times where a 64-token step costs much more than a 32- and a 16-token one: prompts are split to fill
    the smaller buckets exactly, and the greedy tokens stay HF's."""
    path = tiny_model_dir("llama")
    hf = load_hf_model(path)
    llm = LLM(path, compile_guard=True, **ARGS)
    llm.engine.core.scheduler.set_step_costs({16: 0.01, 32: 0.02, 64: 0.1})
    steps = []
    execute = llm.engine.core.runner.prepare

    def recording(out):
        steps.append(sorted(out.num_new_tokens))
        return execute(out)

    monkeypatch.setattr(llm.engine.core.runner, "prepare", recording)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    got = llm.generate(prompts(), greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [hf_greedy(hf, p, 12) for p in prompts()]
    # the 125 prompt tokens (5, 17, 40, 63): the first step fills 32 tokens exactly (5 + 17 + 10 of the 40), not
    # all 64 of the budget; the 40-token prompt's last 30 come beside two decodes in the next
    assert steps[:2] == [[5, 10, 17], [1, 1, 30]]


def test_steps_that_cost_their_tokens_are_timed_full_and_planned_by_tokens(tiny_model_dir):
    """Packed float32 CPU weights skip a step's padding rows: the warm steps still time whole buckets (their
    template counts every token and sequence row as real), and the scheduler and the clock get the times as
    by-token costs."""
    llm = LLM(tiny_model_dir("llama"), late_scheduling=True, **ARGS)
    core = llm.engine.core
    assert core.runner.pays_for_padding is False
    templates = [core.runner._template(t) for t in core.runner.buckets]
    assert [int(x.attn.num_real_tokens) for x in templates] == core.runner.buckets
    assert [int(x.head_rows) for x in templates] == [x.logits_indices.shape[0] for x in templates]
    seeded = {}
    core.scheduler.set_step_costs = lambda times, by_tokens=False: seeded.update(costs=(times, by_tokens))
    times = core.warm_steps()
    assert seeded["costs"] == (times, True)
    assert core.clock is not None and core.clock._costs is not None and core.clock._costs.by_tokens
    plain = LLM(tiny_model_dir("llama"), attention_backend="reference", **ARGS)
    assert plain.engine.core.runner.pays_for_padding is True

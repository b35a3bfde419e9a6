"""The engine core hands on values, not live objects: its records carry everything the output side reads, so
`AsyncLLM`'s output thread never touches a `Request` the engine thread is still writing."""

from __future__ import annotations

import dataclasses

import pytest
from transformers import AutoTokenizer

from jaxpaged import SamplingParams
from jaxpaged.bench.dummy_model import write_dummy_model
from jaxpaged.engine.arg_utils import EngineArgs
from jaxpaged.engine.core_output import EngineCoreOutput, EngineGauges
from jaxpaged.engine.llm_engine import LLMEngine
from jaxpaged.engine.output_processor import OutputProcessor, RequestOutputKind
from jaxpaged.metrics import EngineMetrics
from jaxpaged.request import Request

PLAIN = (str, int, float, bool, type(None))


def plain(x) -> bool:
    if isinstance(x, (list, tuple)):
        return all(map(plain, x))
    return isinstance(x, PLAIN)


@pytest.fixture(scope="module")
def dummy_dir(tmp_path_factory):
    return write_dummy_model(str(tmp_path_factory.mktemp("dummy")), "tiny")


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_core_hands_on_plain_records(dummy_dir, async_scheduling):
    engine = LLMEngine.from_engine_args(EngineArgs(model=dummy_dir, max_num_seqs=4, max_num_batched_tokens=32,
                                                   max_model_len=128, async_scheduling=async_scheduling), stub=True)
    for i in range(3):
        engine.add_request(str(i), list(range(3, 20 + 5 * i)), SamplingParams(max_tokens=4 + i, ignore_eos=True,
                                                                               n=1 + i % 2))
    records, gauges = [], []
    while engine.has_unfinished_requests():
        step = engine.core.step()
        records += step
        gauges.append(engine.core.gauges())
        engine.output.process(step)
    assert records and all(isinstance(r, EngineCoreOutput) for r in records)
    assert all(plain(getattr(r, f.name)) for r in records for f in dataclasses.fields(r))
    assert all(isinstance(g, EngineGauges) and plain([g.num_running, g.kv_usage, g.kv_blocks_used]) for g in gauges)
    ended = [r.request_id for r in records if r.finished]
    assert sorted(ended) == sorted(set(ended)) and len(ended) == 4  # (3 requests, one of them n=2)
    assert {r.finish_reason for r in records if r.finished} == {"length"}
    assert gauges[-1].num_running == 0 and gauges[-1].kv_blocks_used == 0


def test_the_output_side_reads_only_the_records(dummy_dir):
    """Outputs built from records alone: the core's request is scribbled over after `add`, and the tokens, text,
    logprobs, prompt logprobs, cached-token count and finish come out as the records said."""
    tok = AutoTokenizer.from_pretrained(dummy_dir)
    prompt = [40, 41, 42, 43]
    params = SamplingParams(max_tokens=3, logprobs=1, prompt_logprobs=1)
    req = Request("r-0", prompt, params, seed=0)
    proc = OutputProcessor(tok, EngineMetrics())
    proc.add("r", None, prompt, [req], RequestOutputKind.CUMULATIVE)
    req.output_token_ids.extend([99, 98])
    req.output_logprobs.extend([(0.0, 1, [99], [0.0])] * 2)
    req.prompt_logprob_rows.clear()
    req.num_cached_tokens = 1234
    rows = [(t, -1.0, 2, [5], [-0.5]) for t in prompt[1:]]
    a, b = 50, 60
    out, stopped = proc.process([EngineCoreOutput("r-0", a, logprob=(-0.25, 1, [a], [-0.25]), prompt_logprob_rows=rows,
                                                  num_cached_tokens=0, first_scheduled_time=req.arrival_time)])
    assert stopped == [] and out[0].outputs[0].token_ids == [a] and not out[0].finished
    assert len(out[0].prompt_logprobs) == len(prompt) and out[0].prompt_logprobs[1][prompt[1]].logprob == -1.0
    assert out[0].num_cached_tokens == 0
    out, _ = proc.process([EngineCoreOutput("r-0", b, True, "length", None, (-0.5, 2, [a], [-0.1]))])
    c = out[0].outputs[0]
    assert c.token_ids == [a, b] and c.text.strip() == "w50 w60" and c.finish_reason == "length"
    assert c.cumulative_logprob == pytest.approx(-0.75) and c.logprobs[1][b].rank == 2 and out[0].finished

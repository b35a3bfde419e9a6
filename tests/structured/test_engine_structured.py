"""Structured output through the engine, on a tiny random-weight model with a byte-level tokenizer: random
weights pick arbitrary tokens, so only the mask keeps outputs inside their constraint."""

import json
import re

import jsonschema
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams

REGEX = r"[a-z]{2,6}@[a-z]{2,5}\.(com|org)"
CHOICES = ["red", "green", "blue (dark)"]
SCHEMAS = [
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": -5, "maximum": 99},
                                      "ok": {"type": "boolean"}}, "required": ["n", "ok"]},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
                                      "name": {"type": "string", "maxLength": 6}},
     "required": ["tags", "name"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"x": {"type": "integer", "minimum": 0,
                                                                       "maximum": 9}},
                                "required": ["x"], "additionalProperties": False}, "minItems": 1, "maxItems": 2},
]
PROMPT = "the quick brown fox"


def constrained(seed: int | None):
    """(params, check) pairs: every kind of constraint, greedy (seed None) or sampled at temperature 1."""
    sample = dict(temperature=0.0) if seed is None else dict(temperature=1.0, seed=seed)
    cases = [(StructuredOutputsParams(choice=CHOICES), lambda t: t in CHOICES),
             (StructuredOutputsParams(regex=REGEX), lambda t: re.fullmatch(REGEX, t) is not None)]
    # (json_object is left to the SmolLM2 test: unbounded strings never end under random weights)
    for schema in SCHEMAS:
        cases.append((StructuredOutputsParams(json=schema),
                      lambda t, s=schema: jsonschema.validate(json.loads(t), s) is None))
    return [(SamplingParams(max_tokens=160, structured_outputs=c, **sample), check) for c, check in cases]


@pytest.fixture(scope="module", params=[True, False], ids=["async", "sync"])
def llm(request, tiny_model_dir):
    return LLM(tiny_model_dir("llama-bytes"), max_num_batched_tokens=128, num_kv_blocks=128, compile_guard=True,
               async_scheduling=request.param)


def test_every_output_satisfies_its_constraint(llm):
    cases = constrained(None) + constrained(1) + constrained(2)
    outs = llm.generate([PROMPT] * len(cases), [p for p, _ in cases], use_tqdm=False)
    for (params, check), out in zip(cases, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", (params.structured_outputs, text)
        assert check(text), (params.structured_outputs, text)


def test_free_requests_are_unchanged_by_constrained_neighbours(llm):
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [PROMPT, "hello there", "a b c"]
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, free, use_tqdm=False)]
    cases = constrained(None)
    mixed = llm.generate(prompts + [PROMPT] * len(cases), [free] * 3 + [p for p, _ in cases], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for (_, check), out in zip(cases, mixed[3:]):
        assert check(out.outputs[0].text)


def test_greedy_constrained_output_is_the_same_sync_and_async(llm, tiny_model_dir):
    """A constrained greedy output is the masked argmax at each step, whatever the scheduling mode."""
    cases = constrained(None)
    got = [o.outputs[0].text for o in llm.generate([PROMPT] * len(cases), [p for p, _ in cases], use_tqdm=False)]
    other = LLM(tiny_model_dir("llama-bytes"), max_num_batched_tokens=64, num_kv_blocks=128,
                async_scheduling=not llm.engine.config.async_scheduling)
    assert [o.outputs[0].text for o in other.generate([PROMPT] * len(cases), [p for p, _ in cases],
                                                      use_tqdm=False)] == got


def test_each_of_n_samples_satisfies_the_constraint(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=64,
                            structured_outputs=StructuredOutputsParams(regex=REGEX))
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    assert len(out.outputs) == 4 and len({o.text for o in out.outputs}) > 1
    assert all(re.fullmatch(REGEX, o.text) for o in out.outputs)


def test_stop_strings_and_max_tokens_cut_a_constrained_output(llm):
    regex = StructuredOutputsParams(regex="(ab)+c")
    stop, short = llm.generate([PROMPT] * 2, [
        SamplingParams(temperature=0, max_tokens=40, stop=["b"], structured_outputs=regex),
        SamplingParams(temperature=0, max_tokens=3, structured_outputs=StructuredOutputsParams(regex="[xy]{8}"))],
        use_tqdm=False)
    assert stop.outputs[0].text == "a" and stop.outputs[0].finish_reason == "stop"
    assert re.fullmatch("[xy]{3}", short.outputs[0].text) and short.outputs[0].finish_reason == "length"


def test_preempted_requests_keep_their_constraint(tiny_model_dir):
    llm = LLM(tiny_model_dir("llama-bytes"), max_num_batched_tokens=64, num_kv_blocks=12, compile_guard=True,
              enable_prefix_caching=False)
    cases = constrained(5) * 2
    for params, _ in cases:
        params.max_tokens = 100
    outs = llm.generate([f"{i} {PROMPT * 2}" for i in range(len(cases))], [p for p, _ in cases], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for (_, check), out in zip(cases, outs):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text


def test_json_fields_come_in_the_schema_order(llm):
    schema = {"type": "object", "properties": {"zeta": {"type": "integer", "minimum": 0, "maximum": 9},
                                               "alpha": {"type": "boolean"}, "mid": {"enum": ["x", "y"]}},
              "required": ["zeta", "alpha", "mid"], "additionalProperties": False}
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, structured_outputs=
                                                   StructuredOutputsParams(json=schema)), use_tqdm=False)
    assert list(json.loads(out.outputs[0].text)) == ["zeta", "alpha", "mid"]


def test_a_complete_output_ends_the_request_even_under_min_tokens(llm):
    """min_tokens would suppress the EOS that is all a finished grammar allows: the request ends instead."""
    (out,) = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=20, min_tokens=10,
                                                   structured_outputs=StructuredOutputsParams(choice=CHOICES)),
                          use_tqdm=False)
    assert out.outputs[0].text in CHOICES and out.outputs[0].finish_reason == "stop"


def test_bad_constraint_is_an_error_before_any_work(llm):
    with pytest.raises(ValueError, match="structured_outputs.json.*dependentSchemas"):
        llm.generate([PROMPT], SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "object", "dependentSchemas": {"a": {}}})), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests()

"""Structured output on the default model (SmolLM2-135M): 50 generated JSON schemas, choices and a regex,
every output valid; free requests in the same batch unchanged (greedy)."""

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxpaged import LLM, SamplingParams, StructuredOutputsParams

WORDS = ["name", "city", "age", "score", "tags", "active", "color", "size", "items", "owner", "price", "level"]


def random_schema(rng: np.random.Generator, depth: int = 0) -> dict:
    """An object schema: strings (bounded, or enums), integers and numbers with bounds (numbers in cents: an
    unbounded decimal can repeat digits under greedy decoding until max_tokens), booleans, arrays, nested
    objects, and a random subset required."""
    props = {}
    for key in rng.choice(WORDS, size=int(rng.integers(1, 5)), replace=False):
        kind = rng.choice(["string", "enum", "integer", "number", "boolean", "array", "object"][: 7 - depth])
        if kind == "string":
            props[key] = {"type": "string", "minLength": 1, "maxLength": int(rng.integers(3, 16))}
        elif kind == "enum":
            props[key] = {"enum": [str(w) for w in rng.choice(WORDS, size=3, replace=False)]}
        elif kind == "integer":
            lo = int(rng.integers(-50, 50))
            props[key] = {"type": "integer", "minimum": lo, "maximum": lo + int(rng.integers(1, 500))}
        elif kind == "number":
            props[key] = {"type": "number", "minimum": 0, "maximum": float(rng.integers(1, 100)),
                          "multipleOf": 0.01}
        elif kind == "boolean":
            props[key] = {"type": "boolean"}
        elif kind == "array":
            item = {"type": "integer", "minimum": 0, "maximum": 9} if rng.random() < 0.5 else \
                {"type": "string", "maxLength": 8}
            props[key] = {"type": "array", "items": item, "minItems": 1, "maxItems": int(rng.integers(1, 4))}
        else:
            props[key] = random_schema(rng, depth + 1)
    required = [k for k in props if rng.random() < 0.7] or [next(iter(props))]
    return {"type": "object", "properties": props, "required": required, "additionalProperties": False}


SCHEMAS = [random_schema(np.random.default_rng(i)) for i in range(50)]


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(smollm2_path, max_num_seqs=64, compile_guard=True)


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def test_fifty_json_schemas_all_validate(llm):
    params = [SamplingParams(temperature=0, max_tokens=200, structured_outputs=StructuredOutputsParams(json=s))
              for s in SCHEMAS]
    outs = llm.chat([ask(f"Reply with JSON matching this schema: {json.dumps(s)}") for s in SCHEMAS], params,
                    use_tqdm=False)
    for schema, out in zip(SCHEMAS, outs):
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_json_object_choice_regex_and_free_neighbours(llm):
    free = SamplingParams(temperature=0, max_tokens=32)
    free_prompts = [ask("Name three rivers."), ask("What is 2 + 2?")]
    alone = [o.outputs[0].token_ids for o in llm.chat(free_prompts, free, use_tqdm=False)]
    choices = ["positive", "negative", "neutral"]
    date = r"\d{4}-\d{2}-\d{2}"
    constrained = [
        (ask("Is 'I loved it' positive or negative?"), StructuredOutputsParams(choice=choices),
         lambda t: t in choices),
        (ask("When did the Apollo 11 landing happen?"), StructuredOutputsParams(regex=date),
         lambda t: re.fullmatch(date, t)),
        (ask("Describe a book as JSON."), StructuredOutputsParams(json_object=True),
         lambda t: isinstance(json.loads(t), dict)),
    ]
    outs = llm.chat(free_prompts + [m for m, _, _ in constrained],
                    [free] * 2 + [SamplingParams(temperature=0, max_tokens=200, structured_outputs=c)
                                  for _, c, _ in constrained], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2]] == alone
    for (_, _, check), out in zip(constrained, outs[2:]):
        assert out.outputs[0].finish_reason == "stop" and check(out.outputs[0].text), out.outputs[0].text

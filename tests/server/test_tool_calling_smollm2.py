"""Tool calling on the default model (SmolLM2-135M) through the `openai` client: tool_choice "required" over 50
generated argument schemas (with a second tool beside each; half with parallel_tool_calls false) always gives
calls that name a tool and validate against its schema, streamed as it is answered whole; a named function likewise; "auto" with the Hermes parser
loses no text when the model writes no call (the reply equals tool_choice "none"'s, greedy)."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import numpy as np
import openai
import pytest

from server.state import ChatOptions
from tests.server.conftest import API_KEY, serving
from tests.structured.test_structured_smollm2 import random_schema

SCHEMAS = [random_schema(np.random.default_rng(100 + i)) for i in range(50)]
CLOCK = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}}, "required": ["zone"],
         "additionalProperties": False}


def tools_for(schema: dict) -> list[dict]:
    return [{"type": "function", "function": {"name": "record", "description": "Store a record",
                                              "parameters": schema}},
            {"type": "function", "function": {"name": "clock", "description": "The time in a zone",
                                              "parameters": CLOCK}}]


@pytest.fixture(scope="module")
def server(smollm2_path):
    with serving(smollm2_path, max_model_len=1024, num_kv_blocks=1200, max_num_seqs=64, max_num_batched_tokens=512,
                 chat=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")) as s:
        yield s


def messages(i: int) -> list[dict]:
    return [{"role": "user", "content": f"Make up record number {i} and store it."}]


def test_required_calls_fit_their_schemas_over_50_schemas(server):
    async def go():
        c = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
        return await asyncio.gather(*(c.chat.completions.create(
            model="tiny", messages=messages(i), tools=tools_for(s), tool_choice="required", temperature=0.7, seed=i,
            max_tokens=300, parallel_tool_calls=bool(i % 2)) for i, s in enumerate(SCHEMAS)))
    answers = asyncio.run(go())
    for i, (schema, r) in enumerate(zip(SCHEMAS, answers)):
        choice = r.choices[0]
        if i % 2 == 0:  # parallel_tool_calls false: one call, and the list closes after it
            assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1, choice
        else:  # (a small model may repeat calls until max_tokens: the whole ones are kept)
            assert choice.finish_reason in ("tool_calls", "length") and choice.message.tool_calls, choice
        for call in choice.message.tool_calls:
            jsonschema.validate(json.loads(call.function.arguments),
                                {"record": schema, "clock": CLOCK}[call.function.name])


def test_streamed_required_and_named_calls_equal_the_answer(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    for choice in ("required", {"type": "function", "function": {"name": "record"}}):
        kw = dict(model="tiny", messages=messages(7), tools=tools_for(SCHEMAS[7]), tool_choice=choice,
                  temperature=0, max_tokens=300)
        whole = c.chat.completions.create(**kw).choices[0]
        calls: list[list[str]] = []
        for chunk in c.chat.completions.create(**kw, stream=True):
            for d in (chunk.choices[0].delta.tool_calls or []) if chunk.choices else []:
                if d.index == len(calls):
                    calls.append([d.function.name, ""])
                calls[d.index][1] += d.function.arguments or ""
        assert [[t.function.name, t.function.arguments] for t in whole.message.tool_calls] == calls
        assert whole.finish_reason == ("tool_calls" if choice == "required" else "stop")
        jsonschema.validate(json.loads(calls[0][1]), SCHEMAS[7] if calls[0][0] == "record" else CLOCK)


def test_auto_without_a_call_is_the_plain_reply(server):
    c = openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "Say hello."}], tools=tools_for(SCHEMAS[0]),
              temperature=0, max_tokens=24)
    auto, none = (c.chat.completions.create(**kw, tool_choice=t).choices[0] for t in ("auto", "none"))
    assert auto.message.content == none.message.content and auto.message.content
    assert not auto.message.tool_calls and auto.finish_reason == none.finish_reason

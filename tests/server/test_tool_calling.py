"""Tool calling through the official `openai` client on a tiny random-weight model with a byte-level tokenizer
(only the grammar keeps its replies valid): tool_choice "required" and a named function always give calls whose
names are tools and whose arguments fit the tool's schema, streamed and not; "auto" parses the calls a model
writes (here a reply forced into Hermes' format by a regex, so the parser reads what the engine generated);
"none" leaves the reply alone; bad tool fields are 400s naming the field; an agent loop runs a Python function
and sends its result back."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from server.state import ChatOptions
from tests.server.conftest import API_KEY, post, serving

WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                                        "b": {"type": "integer", "minimum": 0, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
HERMES = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "c"}}\n</tool_call>'


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir("llama-bytes"), max_model_len=512, num_kv_blocks=512,
                 chat=ChatOptions(enable_auto_tool_choice=True, tool_call_parser="hermes")) as s:
        yield s


def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def streamed(stream) -> dict[int, dict]:
    """Per choice: content, the calls rebuilt from their deltas, the finish reason; checks the deltas' shape (id,
    type and name in a call's first delta only)."""
    out: dict[int, dict] = {}
    for chunk in stream:
        for c in chunk.choices:
            got = out.setdefault(c.index, {"content": "", "calls": [], "finish": None})
            got["content"] += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                if d.index == len(got["calls"]):
                    assert d.id and d.type == "function" and d.function.name, d
                    got["calls"].append({"id": d.id, "name": d.function.name, "arguments": ""})
                else:
                    assert d.index == len(got["calls"]) - 1 and d.id is None and d.function.name is None, d
                got["calls"][d.index]["arguments"] += d.function.arguments or ""
            got["finish"] = c.finish_reason or got["finish"]
    return out


def check_calls(calls: list[tuple[str, str]]) -> None:
    assert calls
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])


def test_required_calls_are_valid_streamed_and_not(server):
    c = client(server)
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=4,
                                  temperature=1.0, seed=3, max_tokens=300)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls"
        check_calls([(t.function.name, t.function.arguments) for t in choice.message.tool_calls])
        assert all(t.id.startswith("call_") and t.type == "function" for t in choice.message.tool_calls)
    s = streamed(c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=4,
                                           temperature=1.0, seed=3, max_tokens=300, stream=True))
    for j, choice in enumerate(r.choices):  # (same seed: the same calls, streamed)
        assert s[j]["finish"] == "tool_calls" and s[j]["content"] == ""
        assert [(x["name"], x["arguments"]) for x in s[j]["calls"]] == [
            (t.function.name, t.function.arguments) for t in choice.message.tool_calls]


def test_a_named_function_and_parallel_tool_calls_false(server):
    c = client(server)
    named = {"type": "function", "function": {"name": "add"}}
    r = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named, n=3,
                                  temperature=1.0, seed=5, max_tokens=100)
    for choice in r.choices:
        assert choice.finish_reason == "stop"  # (a named function's reply: OpenAI's and vLLM's reason)
        assert [t.function.name for t in choice.message.tool_calls] == ["add"]
        check_calls([("add", choice.message.tool_calls[0].function.arguments)])
    s = streamed(c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice=named,
                                           temperature=1.0, seed=5, max_tokens=100, stream=True))
    check_calls([(x["name"], x["arguments"]) for x in s[0]["calls"]])
    one = c.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="required", n=4,
                                    parallel_tool_calls=False, temperature=1.0, seed=9, max_tokens=300)
    assert all(len(choice.message.tool_calls) == 1 for choice in one.choices)


def test_required_with_tools_whose_schemas_have_definitions(server):
    """($defs, as pydantic writes nested models: the required list's schema carries every tool's definitions.)"""
    place = {"$defs": {"Place": {"type": "object", "properties": {"city": {"enum": ["Oslo", "Lima"]}},
                                 "required": ["city"], "additionalProperties": False}},
             "type": "object", "properties": {"where": {"$ref": "#/$defs/Place"}}, "required": ["where"],
             "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "visit", "parameters": place}}, TOOLS[1]]
    r = client(server).chat.completions.create(model="tiny", messages=USER, tools=tools, tool_choice="required",
                                               n=3, temperature=1.0, seed=4, max_tokens=300)
    for choice in r.choices:
        for t in choice.message.tool_calls:
            jsonschema.validate(json.loads(t.function.arguments), place if t.function.name == "visit" else ADD)
    clash = [tools[0], {"type": "function", "function": {"name": "other", "parameters": {
        "$defs": {"Place": {"type": "string"}}, "type": "object"}}}]
    err = post(server, "/v1/chat/completions", {"messages": USER, "tools": clash, "tool_choice": "required"},
               status=400)["error"]
    assert err["param"] == "tools" and "Place" in err["message"]


def test_auto_parses_the_calls_the_model_writes(server):
    """(The regex makes the random model write a Hermes call; the parser reads it out of the generated text.)"""
    c = client(server)
    kw = dict(model="tiny", messages=USER, tools=TOOLS, temperature=1.0, seed=1, max_tokens=200,
              extra_body={"structured_outputs": {"regex": "I will check\\. " + _regex(HERMES)}})
    r = c.chat.completions.create(**kw)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content == "I will check. "
    assert [(t.function.name, json.loads(t.function.arguments)) for t in m.tool_calls] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]
    s = streamed(c.chat.completions.create(**kw, stream=True))[0]
    assert s["content"] == "I will check. " and "<tool_call>" not in s["content"]  # (no text of the call leaks)
    assert [(x["name"], json.loads(x["arguments"])) for x in s["calls"]] == [
        ("get_weather", {"city": "Oslo", "unit": "c"})]
    plain = c.chat.completions.create(**{**kw, "tool_choice": "none"})  # none: the same text, not parsed
    assert plain.choices[0].message.content == "I will check. " + HERMES and not plain.choices[0].message.tool_calls
    assert plain.choices[0].finish_reason == "stop"


def _regex(text: str) -> str:
    import re
    return re.escape(text).replace("\\\n", "\\n")


def test_an_agent_loop_runs_a_function_and_answers(server):
    """The client asks, the model calls, Python runs the call, the result goes back in a tool message."""
    c = client(server)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    r = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                  tool_choice={"type": "function", "function": {"name": "add"}}, temperature=1.0,
                                  seed=2, max_tokens=100)
    call = r.choices[0].message.tool_calls[0]
    def add(a: int, b: int) -> int:  # (the function the agent runs)
        return a + b

    result = add(**json.loads(call.function.arguments))
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": str(result)}]
    final = c.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="none",
                                      max_tokens=8, temperature=0)
    assert final.choices[0].finish_reason in ("stop", "length") and final.choices[0].message.content is not None
    assert not final.choices[0].message.tool_calls


@pytest.mark.parametrize("body,field,words", [
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools", "name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "frobnicate"}}}]},
     "tools", "schema"),
    ({"tools": [{"type": "function", "function": {"name": "f"}}, {"type": "function", "function": {"name": "f"}}]},
     "tools", "two tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "sometimes"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
     "constraint"),
    ({"messages": USER + [{"role": "tool", "content": "4"}]}, "messages", "tool_call_id"),
    ({"messages": USER + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{not json"}}]}]},
     "messages", "not JSON"),
    ({"functions": [{"name": "f"}]}, "functions", "tools"),
])
def test_bad_tool_fields_are_400s_naming_the_field(server, body, field, words):
    err = post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, **body}, status=400)["error"]
    assert err["param"] == field and words in err["message"], err


def test_completions_refuse_tools(server):
    err = post(server, "/v1/completions", {"prompt": "x", "tools": TOOLS}, status=400)["error"]
    assert err["param"] == "tools"

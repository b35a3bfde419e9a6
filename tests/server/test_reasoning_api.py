"""Reasoning outputs and tools in the chat template, on a tiny random model whose tokenizer has <think> and
</think> tokens and a Qwen3-like template (tests/tiny_models.py): `--reasoning-parser qwen3` splits the reply at
</think> into reasoning_content and content, streamed and not, exactly where the unparsed text (the same tokens
through /v1/completions) has it; enable_thinking false leaves it all content; an output constraint applies only
after the thinking. The replies are kept to a few tokens with allowed_token_ids, so </think> comes soon."""

from __future__ import annotations

import json

import openai
import pytest

from server.state import ChatOptions
from tests.server.conftest import API_KEY, post, serving

USER = [{"role": "user", "content": "Think, then answer."}]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir("llama-think"), max_model_len=512, num_kv_blocks=512,
                 chat=ChatOptions(reasoning_parser="qwen3")) as s:
        yield s


@pytest.fixture(scope="module")
def ids(server):
    tok = server.engine.tokenizer
    return {t: tok.convert_tokens_to_ids(t) for t in ("a", "b", "{", "}", "</think>", "<|im_end|>")}


def client(server):
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def chat(server, body: dict, **kw):
    """The openai client's chat call for `body` (vLLM's fields through extra_body)."""
    extra = {k: body[k] for k in ("allowed_token_ids", "chat_template_kwargs") if k in body}
    rest = {k: v for k, v in body.items() if k not in extra}
    return client(server).chat.completions.create(model="tiny", **rest, **kw, extra_body=extra)


def raw_text(server, body: dict) -> str:
    """The reply's text unparsed: the chat prompt's tokens (from /tokenize) through /v1/completions, same sampling."""
    prompt = post(server, "/tokenize", {"messages": body["messages"],
                                        "chat_template_kwargs": body.get("chat_template_kwargs")})["tokens"]
    sampling = {k: v for k, v in body.items() if k not in ("messages", "chat_template_kwargs")}
    return post(server, "/v1/completions", {"prompt": prompt, **sampling})["choices"][0]["text"]


def test_thinking_split_streamed_and_not(server, ids):
    body = dict(messages=USER, max_tokens=24, temperature=1.0, seed=11,
                allowed_token_ids=[ids["a"], ids["b"], ids["</think>"]])
    raw = raw_text(server, body)
    assert "</think>" in raw  # (the seed makes it close its thinking)
    reasoning, content = raw.split("</think>", 1)
    m = chat(server, body).choices[0].message
    assert (m.reasoning_content, m.content) == (reasoning, content)
    got = {"reasoning_content": "", "content": ""}
    for chunk in chat(server, body, stream=True):
        for c in chunk.choices:
            for key in got:
                got[key] += getattr(c.delta, key, None) or ""
    assert got == {"reasoning_content": reasoning, "content": content}


def test_thinking_disabled_is_all_content(server, ids):
    body = dict(messages=USER, max_tokens=12, temperature=1.0, seed=11, chat_template_kwargs={"enable_thinking": False},
                allowed_token_ids=[ids["a"], ids["b"], ids["</think>"]])
    m = chat(server, body)
    assert m.choices[0].message.reasoning_content is None
    assert m.choices[0].message.content == raw_text(server, body)


def test_a_constraint_applies_after_the_thinking(server, ids):
    """Free thinking (a, b, braces in any order), then `</think>`, then the JSON object the format asks for."""
    r = chat(server, dict(messages=USER, max_tokens=48, temperature=1.0, seed=4,
                          allowed_token_ids=[ids[t] for t in ("a", "b", "{", "}", "</think>", "<|im_end|>")]),
             response_format={"type": "json_object"})
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "stop"
    assert m.reasoning_content and set(m.reasoning_content) <= set("ab{}")
    assert json.loads(m.content) == {}


def test_tools_and_calls_reach_the_template(server):
    """The template gets the tools, an assistant's calls with their arguments as objects, and the tool's result."""
    digit = {"type": "integer", "minimum": 0, "maximum": 9}
    tools = [{"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "properties": {"a": digit, "b": digit}, "required": ["a", "b"], "additionalProperties": False}}}]
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    tokens = post(server, "/tokenize", {"messages": messages, "tools": tools})["tokens"]
    text = server.engine.tokenizer.decode(tokens)
    assert json.dumps(tools[0]) in text
    assert '<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call>' in text
    assert "<tool_response>5</tool_response>" in text
    r = client(server).chat.completions.create(model="tiny", messages=messages, tools=tools, tool_choice="required",
                                               max_tokens=64, temperature=1.0, seed=5,
                                               extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    call = r.choices[0].message.tool_calls[0].function  # (enable_thinking false: the prompt closed the thinking)
    assert call.name == "add" and set(json.loads(call.arguments)) == {"a", "b"}

"""The tool and reasoning parsers on canned model texts: what they make of a whole text, and the same when the
text arrives split at every character boundary (and one character at a time), as a stream delivers it."""

from __future__ import annotations

import json

import pytest

from server.chat_output import ChoiceParser
from server.reasoning import ReasoningParser, reply_start
from server.tool_parsers import TOOL_PARSERS
from server.tool_parsers.forced import NamedCallParser, RequiredCallsParser


def run(parser, pieces: list[str]) -> tuple[str, list[tuple[str, str]]]:
    """(content, [(name, arguments)]) from a parser fed `pieces`, checking the stream's shape on the way: a call's
    name comes in its first piece, exactly once, and calls are numbered in order."""
    content, calls = "", []
    for delta in [parser.feed(p) for p in pieces] + [parser.finish()]:
        content += delta.content
        for c in delta.calls:
            if c.index == len(calls):
                assert c.name is not None, "a call's first piece names it"
                calls.append([c.name, ""])
            else:
                assert c.index == len(calls) - 1 and c.name is None, (c, calls)
            calls[c.index][1] += c.arguments
    return content, [tuple(c) for c in calls]


def splits(text: str):
    yield [text]
    yield list(text)
    for k in range(1, len(text)):
        yield [text[:k], text[k:]]


WEATHER = '{"city": "Paris", "unit": "c"}'
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
     "", [("get_weather", WEATHER)]),
    ("hermes", (f'Let me check.<tool_call>{{"arguments": {WEATHER}, "name": "get_weather"}}</tool_call>\n'
               '<tool_call>{"name": "now", "arguments": {}}</tool_call>'),
     "Let me check.", [("get_weather", WEATHER), ("now", "{}")]),
    ("hermes", 'No call here, just <b>text</b> and a {"brace"}.', 'No call here, just <b>text</b> and a {"brace"}.', []),
    ("hermes", ('<tool_call>{"name": "f", "arguments": {"s": "a \\"}\\" </tool_call> b", "n": [1, {"x": null}]}}'
               '</tool_call>'), "", [("f", '{"s": "a \\"}\\" </tool_call> b", "n": [1, {"x": null}]}')]),
    ("llama3_json", f'{{"name": "get_weather", "parameters": {WEATHER}}}', "", [("get_weather", WEATHER)]),
    ("llama3_json", f'<|python_tag|>{{"name": "a", "parameters": {{}}}}; {{"name": "b", "parameters": {WEATHER}}}',
     "", [("a", "{}"), ("b", WEATHER)]),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("mistral", (f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "now", "arguments": '
                '{"tz": "UTC"}}]'), "", [("get_weather", WEATHER), ("now", '{"tz": "UTC"}')]),
    ("mistral", f'Sure.[TOOL_CALLS]get_weather[ARGS]{WEATHER}[TOOL_CALLS]now[ARGS]{{}}',
     "Sure.", [("get_weather", WEATHER), ("now", "{}")]),
    ("mistral", "[TOOL no calls]", "[TOOL no calls]", []),
    ("pythonic", '[get_weather(city="Paris", unit=\'c\'), now(), add(xs=[1, 2], opts={"a": (1, 2)})]', "",
     [("get_weather", WEATHER), ("now", "{}"), ("add", '{"xs": [1, 2], "opts": {"a": [1, 2]}}')]),
    ("pythonic", '<|python_start|>[f(s="a, b) ]")]<|python_end|>', "", [("f", '{"s": "a, b) ]"}')]),
    ("pythonic", "It is [sunny] today.", "It is [sunny] today.", []),
    # (forms a review found: a list inside one tag, separators repeated, arguments as a JSON string, a repeated
    # key, mistral's lone object and its newest call ids)
    ("hermes", '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": 1}}]</tool_call>', "",
     [("a", "{}"), ("b", '{"x": 1}')]),
    ("llama3_json", '{"name":"a","parameters":{}}; ; {"name":"b","parameters":{}}', "", [("a", "{}"), ("b", "{}")]),
    ("hermes", '<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>', "", [("f", '{"a": 1}')]),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1}, "arguments": {"b": 2}}</tool_call>', "",
     [("f", '{"a": 1}')]),
    ("mistral", '[TOOL_CALLS] {"name": "f", "arguments": {"a": 1}}', "", [("f", '{"a": 1}')]),
    ("mistral", '[TOOL_CALLS]f[CALL_ID]a1b2c3d4e[ARGS]{"a": 1}', "", [("f", '{"a": 1}')]),
]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_a_parser_reads_a_text_the_same_whole_and_in_pieces(name, text, content, calls):
    for pieces in splits(text):
        got_content, got_calls = run(TOOL_PARSERS[name](), pieces)
        assert got_content == content, pieces
        assert [(n, json.loads(a or "{}")) for n, a in got_calls] == [(n, json.loads(a)) for n, a in calls], pieces
        assert all(a == "" or json.loads(a) is not None for _, a in got_calls)


def test_no_text_of_a_call_reaches_the_content():
    """(While a tag's first characters arrive, they are held back, not sent as content.)"""
    parser = TOOL_PARSERS["hermes"]()
    assert parser.feed("Hi <tool").content == "Hi "
    assert parser.feed("_call>{").content == ""
    assert parser.feed('"name": "f"').calls[0].name == "f"


def test_the_forced_replies():
    text = '[{"name":"get_weather","parameters":{"city":"Paris"}},{"name":"now","parameters":{}}]'
    for pieces in splits(text):
        assert run(RequiredCallsParser(), pieces) == ("", [("get_weather", '{"city":"Paris"}'), ("now", "{}")])
    for pieces in splits(WEATHER):
        assert run(NamedCallParser("get_weather"), pieces) == ("", [("get_weather", WEATHER)])


@pytest.mark.parametrize("start,text,reasoning,content", [
    ("inside", "Let me think.\n</think>\n\nThe answer is 4.", "Let me think.\n", "\n\nThe answer is 4."),
    ("inside", "<think>Hmm</think>4", "Hmm", "4"),
    ("inside", "Still thinking when it ran out", "Still thinking when it ran out", ""),
    ("maybe", "<think>\nstep 1 < step 2\n</think>\n\nDone.", "\nstep 1 < step 2\n", "\n\nDone."),
    ("maybe", "No thinking: <think> only later", "", "No thinking: <think> only later"),
    ("maybe", "<thin", "", "<thin"),
    ("closed", "<think>a</think>b", "", "<think>a</think>b"),
])
def test_reasoning_split_whole_and_in_pieces(start, text, reasoning, content):
    for pieces in splits(text):
        parser, got = ReasoningParser(start), ["", ""]
        for d in [parser.feed(p) for p in pieces] + [parser.finish()]:
            got[0] += d.reasoning
            got[1] += d.content
        assert got == [reasoning, content], pieces


def test_where_a_reply_starts():
    assert reply_start("deepseek_r1", "<|Assistant|><think>\n") == reply_start("qwen3", "assistant\n<think>\n") \
        == "inside"
    assert reply_start("qwen3", "assistant\n") == "maybe" and reply_start("deepseek_r1", "Assistant:") == "inside"
    assert reply_start("qwen3", "<think>\n\n</think>\n\n") == reply_start("deepseek_r1", "</think>") == "closed"


def whole(parser: ChoiceParser, text: str) -> dict:
    parser.feed(text, final=True)
    return parser.message("assistant")


@pytest.mark.parametrize("name,text", [
    ("llama3_json", '{"answer": 42}'), ("pythonic", "[1] First, note this."),
    ("hermes", "Sure <tool_call>not json</tool_call> after"), ("mistral", "[TOOL_CALLS] Sorry, no."),
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": 1]}</tool_call>'),
])
def test_a_free_reply_that_yields_no_whole_call_is_content(name, text):
    """(As vLLM answers it: nothing of the reply is lost.)"""
    m = whole(ChoiceParser(tools=TOOL_PARSERS[name]()), text)
    assert m["content"] == text and "tool_calls" not in m


def test_odd_replies_never_raise():
    deep = '<tool_call>{"name":"f","arguments":{"a":' + "[" * 5000
    assert "tool_calls" not in whole(ChoiceParser(tools=TOOL_PARSERS["hermes"]()), deep)
    big = '<tool_call>{"name":"f","arguments":{"a":' + "1" * 5000 + "}}</tool_call>"
    assert "tool_calls" not in whole(ChoiceParser(tools=TOOL_PARSERS["hermes"]()), big)


def test_a_forced_call_cut_short_is_dropped_not_made_up():
    m = whole(ChoiceParser(tools=RequiredCallsParser()), '[{"name":"a","parameters":{"x":1}},{"name":"b","parameters":')
    assert [c["function"]["name"] for c in m["tool_calls"]] == ["a"]
    named = ChoiceParser(reasoning=ReasoningParser("inside"), tools=NamedCallParser("f"))
    assert named.feed("thinking about it") == {"reasoning_content": "thinking about it"}  # (no call opened yet)
    assert named.feed("</think>\n\n")  == {}
    delta = named.feed('{"a": 1}', final=True)
    assert delta["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"a": 1}'}

"""OpenAI request validation and response shapes, without a server: every field, every error, exactly."""

from __future__ import annotations

import math

import pytest

from jaxpaged.request import Logprob
from jaxpaged.sampling_params import SamplingParams
from server.protocol import (
    APIError,
    Usage,
    cache_salt_from,
    chat_logprobs,
    completion_logprobs,
    get_field,
    prompt_logprobs_json,
    reject_unsupported,
    requested_logprobs,
    sampling_params_from,
)


def error_of(fn, *args, **kw) -> APIError:
    with pytest.raises(APIError) as e:
        fn(*args, **kw)
    return e.value


def test_api_error_body():
    e = APIError("bad", status=404, param="model", err_type="NotFoundError")
    assert e.body() == {"error": {"message": "bad", "type": "NotFoundError", "param": "model", "code": 404}}
    d = APIError("x")
    assert (d.status, d.param, d.err_type) == (400, None, "BadRequestError")


def test_get_field():
    assert get_field({"a": 3}, "a", (int,)) == 3
    assert get_field({}, "a", (int,), 7) == 7
    assert get_field({"a": None}, "a", (int,), 7) == 7
    assert get_field({"a": None}, "a", (int, type(None)), 7, nullable=False) is None
    e = error_of(get_field, {}, "a", (int,))
    assert e.param == "a" and e.message == "'a' is a required field"
    e = error_of(get_field, {"a": True}, "a", (int, float))
    assert e.param == "a" and e.message == "'a' must be int or float, got a boolean"
    assert get_field({"a": True}, "a", (bool,)) is True
    e = error_of(get_field, {"a": "3"}, "a", (int, float))
    assert e.message == "'a' must be int or float, got str" and e.param == "a"


def test_requested_logprobs():
    assert requested_logprobs({}, chat=False) is None
    assert requested_logprobs({"logprobs": 3}, chat=False) == 3
    assert requested_logprobs({"logprobs": 0}, chat=False) == 0
    assert requested_logprobs({}, chat=True) is None
    assert requested_logprobs({"logprobs": False}, chat=True) is None
    assert requested_logprobs({"logprobs": True}, chat=True) == 0
    assert requested_logprobs({"logprobs": True, "top_logprobs": 4}, chat=True) == 4
    e = error_of(requested_logprobs, {"top_logprobs": 2}, chat=True)
    assert e.param == "top_logprobs" and e.message == "'top_logprobs' needs 'logprobs': true"
    assert requested_logprobs({"top_logprobs": 0}, chat=True) is None


def test_sampling_params_from_every_field():
    body = {"n": 2, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 4, "max_tokens": 9, "min_tokens": 2,
            "ignore_eos": True, "stop_token_ids": [5], "stop": "x", "include_stop_str_in_output": True,
            "skip_special_tokens": False, "spaces_between_special_tokens": False, "logprobs": 2,
            "prompt_logprobs": 1, "repetition_penalty": 1.1, "presence_penalty": 0.3, "frequency_penalty": -0.2,
            "min_p": 0.05, "logit_bias": {"5": 2}, "allowed_token_ids": [1, 2], "bad_words": ["w"]}
    p = sampling_params_from(body, default_max_tokens=16)
    want = SamplingParams(n=2, temperature=0.5, top_p=0.9, top_k=7, seed=4, max_tokens=9, min_tokens=2,
                          ignore_eos=True, stop_token_ids=[5], stop=["x"], include_stop_str_in_output=True,
                          skip_special_tokens=False, spaces_between_special_tokens=False, logprobs=2,
                          prompt_logprobs=1, repetition_penalty=1.1, presence_penalty=0.3, frequency_penalty=-0.2,
                          min_p=0.05, logit_bias={5: 2.0}, allowed_token_ids=[1, 2], bad_words=["w"])
    assert p == want


def test_sampling_params_defaults_and_max_tokens():
    assert sampling_params_from({}, default_max_tokens=16) == SamplingParams(max_tokens=16)
    assert sampling_params_from({}, default_max_tokens=None).max_tokens is None
    assert sampling_params_from({"max_tokens": 5, "max_completion_tokens": 3}, default_max_tokens=16).max_tokens == 3
    assert sampling_params_from({"max_completion_tokens": None, "max_tokens": 5},
                                default_max_tokens=16).max_tokens == 5
    assert sampling_params_from({"logprobs": True, "top_logprobs": 2}, default_max_tokens=1, chat=True).logprobs == 2


@pytest.mark.parametrize("body,param", [
    ({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"min_p": 2}, "min_p"), ({"logprobs": 21}, "logprobs"), ({"top_k": "3"}, "top_k"), ({"seed": 1.5}, "seed"),
    ({"stop": 3}, "stop"), ({"logit_bias": []}, "logit_bias"), ({"ignore_eos": 1}, "ignore_eos"),
])
def test_bad_sampling_values_name_their_field(body, param):
    e = error_of(sampling_params_from, body, default_max_tokens=16)
    assert e.status == 400 and e.param == param and param in e.message


@pytest.mark.parametrize("body,param", [
    ({"suffix": "x"}, "suffix"), ({"functions": [{}]}, "functions"), ({"function_call": "auto"}, "function_call"),
    ({"best_of": 3}, "best_of"), ({"best_of": 2, "n": 3}, "best_of"), ({"use_beam_search": True}, "use_beam_search"),
    ({"prompt_embeds": "AAAA"}, "prompt_embeds"),
    ({"logits_processors": ["pkg.Proc"]}, "logits_processors"),
])
def test_unsupported_fields_are_rejected_by_name(body, param):
    if param is None:  # an empty value asks for nothing
        reject_unsupported(body)
        return
    e = error_of(reject_unsupported, body)
    assert e.param == param and "not supported" in e.message and e.status == 400


@pytest.mark.parametrize("body", [
    {}, {"echo": False}, {"suffix": ""}, {"use_beam_search": False}, {"tools": []}, {"tools": None},
    {"response_format": {"type": "text"}}, {"tool_choice": "none"}, {"tool_choice": "auto"}, {"best_of": 1},
    {"best_of": 2, "n": 2},
    {"best_of": None}, {"n": None, "best_of": 1},
])
def test_defaults_of_unsupported_fields_are_accepted(body):
    reject_unsupported(body)


@pytest.mark.parametrize("body,param", [
    ({"tools": [{"type": "function"}]}, "tools"), ({"tool_choice": "required"}, "tool_choice"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
])
def test_tools_are_for_chat_only(body, param):
    e = error_of(reject_unsupported, body)
    assert e.param == param and "chat/completions" in e.message
    reject_unsupported(body, chat=True)  # (read by server/tool_requests.py there)


@pytest.mark.parametrize("body,auto,choice", [
    ({}, False, "none"), ({"tools": []}, False, "none"), ({"tools": [{"function": {"name": "f"}}]}, True, "auto"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": "none"}, False, "none"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": "required"}, False, "required"),
    ({"tools": [{"function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "f"}}},
     False, "named"),
])
def test_tool_choice_defaults_and_modes(body, auto, choice):
    from server.tool_requests import tool_request_from

    assert tool_request_from(body, auto_enabled=auto).choice == choice


def test_auto_tool_choice_needs_the_servers_flags():
    """(vLLM's message; also when tools come without a tool_choice, which then means auto.)"""
    from server.tool_requests import AUTO_NEEDS_FLAGS, tool_request_from

    for body in ({"tools": [{"function": {"name": "f"}}]}, {"tools": [{"function": {"name": "f"}}],
                                                              "tool_choice": "auto"}):
        e = error_of(tool_request_from, body, auto_enabled=False)
        assert e.param == "tool_choice" and e.message == AUTO_NEEDS_FLAGS


def test_the_cli_offers_every_parser():
    from jaxpaged.cli import REASONING_PARSERS, TOOL_CALL_PARSERS
    from server.reasoning import REASONING_PARSERS as served_reasoning
    from server.tool_parsers import TOOL_PARSERS

    assert sorted(TOOL_CALL_PARSERS) == sorted(TOOL_PARSERS) and REASONING_PARSERS == served_reasoning


@pytest.mark.parametrize("body,kind,value", [
    ({"response_format": {"type": "json_object"}}, "json_object", True),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "object"}}}},
     "json", {"type": "object"}),
    ({"structured_outputs": {"regex": "a+"}}, "regex", "a+"),
    ({"structured_outputs": {"choice": ["x", "y"]}}, "choice", ["x", "y"]),
    ({"guided_json": {"type": "array"}}, "json", {"type": "array"}), ({"guided_regex": "b+"}, "regex", "b+"),
    ({"guided_choice": ["a"]}, "choice", ["a"]), ({"guided_grammar": 'root ::= "a"'}, "grammar", 'root ::= "a"'),
])
def test_output_constraints_from_each_request_field(body, kind, value):
    p = sampling_params_from(body, default_max_tokens=16).structured_outputs
    assert p.kind == kind and getattr(p, kind) == value


@pytest.mark.parametrize("body", [{}, {"response_format": {"type": "text"}}, {"guided_json": {}},
                                  {"structured_outputs": None}])
def test_no_constraint(body):
    assert sampling_params_from(body, default_max_tokens=16).structured_outputs is None


@pytest.mark.parametrize("body,param,needle", [
    ({"response_format": "json"}, "response_format", "object"),
    ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema.schema"),
    ({"response_format": {"type": "structural_tag"}}, "response_format", "not supported"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object",
                                                                            "dependentSchemas": {}}}}},
     "response_format", "dependentSchemas"),
    ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "regex"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs", "unknown"),
    ({"structured_outputs": {"json": {}, "regex": "a"}}, "structured_outputs", "exactly one"),
    ({"guided_choice": []}, None, None),  # (empty: asks for nothing)
    ({"guided_choice": "ab"}, "guided_choice", "choice"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex", "one output constraint"),
])
def test_bad_constraints_name_their_field(body, param, needle):
    if param is None:
        assert sampling_params_from(body, default_max_tokens=16).structured_outputs is None
        return
    e = error_of(sampling_params_from, body, default_max_tokens=16)
    assert e.status == 400 and e.param == param and needle in e.message


class _TemplateTokenizer:
    """apply_chat_template's signature and the kwargs it was given, as the rendered "ids"."""

    def __init__(self):
        self.calls = []

    def apply_chat_template(self, messages, *, tokenize, return_dict=False, add_generation_prompt=True,
                            continue_final_message=False, **extra):
        self.calls.append(dict(add_generation_prompt=add_generation_prompt,
                               continue_final_message=continue_final_message, **extra))
        if extra.get("fail"):
            raise ValueError("no such conversation")
        ids = [len(messages), int(add_generation_prompt), int(continue_final_message)]
        return {"input_ids": ids} if tokenize else "x" * sum(ids)

    def encode(self, text, add_special_tokens):
        return [-1] * add_special_tokens + [len(text)]


def test_chat_template_options_reach_the_template():
    from server.chat import render_chat

    tok, msgs = _TemplateTokenizer(), [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert render_chat(tok, msgs, {}) == ([2, 1, 0], "assistant")
    assert render_chat(tok, msgs, {"add_generation_prompt": False, "continue_final_message": True}) == (
        [2, 0, 1], "assistant")
    assert render_chat(tok, msgs[:1], {"add_generation_prompt": False}) == ([1, 0, 0], "user")  # (vLLM's role)
    render_chat(tok, msgs, {"chat_template_kwargs": {"enable_thinking": False}})
    assert tok.calls[-1] == {"add_generation_prompt": True, "continue_final_message": False,
                             "enable_thinking": False}
    render_chat(tok, msgs, {"documents": [{"title": "t", "text": "d"}]})
    assert tok.calls[-1]["documents"] == [{"title": "t", "text": "d"}]
    assert render_chat(tok, msgs, {"add_special_tokens": True})[0] == [-1, 3]  # (the text, tokenized with them)
    # the role follows the field, not chat_template_kwargs (vLLM's get_chat_request_role)
    assert render_chat(tok, msgs[:1], {"chat_template_kwargs": {"add_generation_prompt": False}})[1] == "assistant"
    for body, param in (({"add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                        ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
                        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
                        ({"chat_template": "{{ messages }}"}, "chat_template"), ({"documents": "d"}, "documents"),
                        ({"documents": [1]}, "documents"), ({"documents": [{"text": 2}]}, "documents"),
                        ({"chat_template_kwargs": {"continue_final_message": True}}, "chat_template_kwargs"),
                        ({"chat_template_kwargs": {"fail": True}}, "messages")):
        e = error_of(render_chat, tok, msgs, body)
        assert e.status == 400 and e.param == param


def test_usage():
    assert Usage(3, 4).to_dict() == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def entry(token, lp, rank, text, alts=()):
    e = {t: Logprob(v, r, s) for t, v, r, s in alts}
    e[token] = Logprob(lp, rank, text)
    return e


def test_completion_logprobs():
    lps = [entry(5, -0.5, 1, " the", [(6, -1.5, 2, " a")]), entry(7, -math.inf, 3, "cat", [(8, -0.1, 1, "dog")])]
    got = completion_logprobs(lps, [5, 7], text_offset=10)
    assert got == {"tokens": [" the", "cat"], "token_logprobs": [-0.5, -9999.0],
                   "top_logprobs": [{" a": -1.5, " the": -0.5}, {"dog": -0.1, "cat": -9999.0}],
                   "text_offset": [10, 14]}
    assert completion_logprobs([], []) == {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}


def test_chat_logprobs():
    lps = [entry(5, -0.5, 2, " é", [(6, -0.25, 1, " a"), (9, -3.0, 3, "z")])]
    got = chat_logprobs(lps, [5], 2)
    assert got == {"content": [{"token": " é", "logprob": -0.5, "bytes": [32, 195, 169], "top_logprobs": [
        {"token": " a", "logprob": -0.25, "bytes": [32, 97]}, {"token": " é", "logprob": -0.5, "bytes": [32, 195, 169]},
    ]}]}
    assert chat_logprobs(None, [5], 2) is None
    assert chat_logprobs(lps, [5], 0)["content"][0]["top_logprobs"] == []
    unranked = [{5: Logprob(-0.5, None, "a"), 6: Logprob(-0.7, 1, "b")}]
    assert chat_logprobs(unranked, [5], 3)["content"][0]["top_logprobs"] == [{"token": "b", "logprob": -0.7,
                                                                             "bytes": [98]}]
    assert chat_logprobs([{5: Logprob(-1.0, 1, None)}], [5], 1)["content"][0]["token"] == ""
    assert completion_logprobs([{5: Logprob(-1.0, 1, None)}], [5])["tokens"] == [""]


def test_prompt_logprobs_json():
    assert prompt_logprobs_json(None) is None
    got = prompt_logprobs_json([None, {4: Logprob(-math.inf, 7, "x")}])
    assert got == [None, {"4": {"logprob": -9999.0, "rank": 7, "decoded_token": "x"}}]


def test_completion_prompts_take_add_special_tokens():
    from server.completions import parse_prompts

    tok = _TemplateTokenizer()
    assert [p.token_ids for p in parse_prompts({"prompt": ["ab", [7, 8]]}, tok)] == [[-1, 2], [7, 8]]
    assert parse_prompts({"prompt": "ab", "add_special_tokens": False}, tok)[0].token_ids == [2]


@pytest.mark.parametrize("body,salt", [({}, None), ({"cache_salt": None}, None), ({"cache_salt": "t-1"}, "t-1")])
def test_cache_salt_is_read(body, salt):
    assert cache_salt_from(body) == salt


@pytest.mark.parametrize("salt", ["", 3, ["a"]])
def test_a_cache_salt_must_be_a_non_empty_string(salt):
    e = error_of(cache_salt_from, {"cache_salt": salt})
    assert e.status == 400 and e.param == "cache_salt" and "non-empty string" in e.message


def test_response_format_text_with_extra_keys_asks_for_nothing():
    """(A fuzzed body once made this a 500: "text" with a json_schema beside it.)"""
    body = {"prompt": "x", "response_format": {"type": "text", "json_schema": {"name": "n"}}}
    assert sampling_params_from(body, default_max_tokens=4).structured_outputs is None

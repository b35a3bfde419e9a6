"""OpenAI request validation (into `SamplingParams`) and response shapes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from jaxpaged.request import check_cache_salt
from jaxpaged.sampling_params import SamplingParams, StructuredOutputsParams
from jaxpaged.structured.grammar import compile_grammar


class APIError(Exception):
    """An error answered as OpenAI's JSON error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 err_type: str = "BadRequestError", code: str | int | None = None, headers: dict | None = None):
        super().__init__(message)
        self.message, self.status, self.param, self.err_type = message, status, param, err_type
        self.code = status if code is None else code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


_MISSING = object()


def get_field(body: dict, name: str, kinds: tuple[type, ...], default: Any = _MISSING, *, nullable: bool = True):
    """body[name] checked against `kinds` (bool is never an int here); a missing required field is an error."""
    if name not in body or (body[name] is None and nullable):
        if default is _MISSING:
            raise APIError(f"'{name}' is a required field", param=name)
        return default
    value = body[name]
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got a boolean", param=name)
    if not isinstance(value, kinds):
        raise APIError(f"'{name}' must be {' or '.join(k.__name__ for k in kinds)}, got {type(value).__name__}",
                       param=name)
    return value


def requested_logprobs(body: dict, *, chat: bool) -> int | None:
    """Top alternatives per token: completions' `logprobs: int`, chat's `logprobs: bool` + `top_logprobs`."""
    if chat:
        if not get_field(body, "logprobs", (bool,), False):
            if body.get("top_logprobs"):
                raise APIError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
            return None
        return get_field(body, "top_logprobs", (int,), 0)
    return get_field(body, "logprobs", (int,), None)


# Fields that would change what the user gets, which jaxpaged does not implement yet: rejected, never ignored.
_UNSUPPORTED = {
    "suffix": "'suffix' is not supported",
    "functions": "the deprecated 'functions' is not supported (use 'tools')",
    "function_call": "the deprecated 'function_call' is not supported (use 'tool_choice')",
    "use_beam_search": "beam search is not supported by the server ('use_beam_search'; offline: LLM.beam_search)",
    "prompt_embeds": "'prompt_embeds' is not supported",
    "logits_processors": "custom 'logits_processors' are not supported",
}


def reject_unsupported(body: dict, *, chat: bool = False) -> None:
    """A 400 naming the first field that asks for something jaxpaged cannot do (an absent, null, false or
    empty field asks for nothing; tool_choice 'none' and response_format 'text' are the defaults). Tools are
    served by chat completions only (server/tool_requests.py reads them there)."""
    for name, message in _UNSUPPORTED.items():
        if body.get(name) not in (None, False, [], {}, ""):
            raise APIError(message, param=name)
    if not chat:
        if body.get("tools") not in (None, []):
            raise APIError("'tools' are served by /v1/chat/completions", param="tools")
        if body.get("tool_choice") not in (None, "none", "auto"):
            raise APIError("'tool_choice' is served by /v1/chat/completions", param="tool_choice")
    best_of = body.get("best_of")
    if best_of is not None and best_of != (body.get("n") or 1):
        raise APIError("'best_of' is not supported (use n)", param="best_of")


def check_no_failed_choice(finish_reasons: list) -> None:
    """A choice the engine ended with an error (finish_reason "error": its grammar matcher failed) makes a
    non-streamed answer a 500; a stream carries the reason in that choice's last chunk instead."""
    if "error" in finish_reasons:
        raise APIError("the request failed in the engine (the server log has the cause)", status=500,
                       err_type="InternalServerError")


def cache_salt_from(body: dict) -> str | None:
    """vLLM's `cache_salt`: a non-empty string giving the request a prefix cache of its own (shared only with
    requests that send the same salt), or None."""
    salt = body.get("cache_salt")
    try:
        check_cache_salt(salt)
    except ValueError as e:
        raise APIError(str(e), param="cache_salt") from None
    return salt


# vLLM's older per-kind request fields -> StructuredOutputsParams fields
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def _from_response_format(fmt) -> StructuredOutputsParams | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise APIError("'response_format' must be an object with a 'type'", param="response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        schema = spec.get("schema", spec.get("json_schema")) if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise APIError("response_format 'json_schema' needs json_schema.schema (an object)",
                           param="response_format")
        return StructuredOutputsParams(json=schema)
    raise APIError(f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
                   param="response_format")


def structured_outputs_from(body: dict) -> StructuredOutputsParams | None:
    """The request's output constraint, from `response_format`, vLLM's `structured_outputs` or its older
    `guided_*` fields (at most one of them); its grammar is checked here so a bad one is a 400 naming the field."""
    plain = {"type": "text"}
    sources = [name for name in ("response_format", "structured_outputs", *_GUIDED)
               if body.get(name) not in (None, False, [], {}, "") and not (name == "response_format"
                                                                           and body[name] == plain)]
    if not sources:
        return None
    if len(sources) > 1:
        raise APIError(f"give one output constraint, not {' and '.join(sources)}", param=sources[1])
    name = sources[0]
    try:
        if name == "response_format":
            params = _from_response_format(body[name])
        elif name == "structured_outputs":
            params = StructuredOutputsParams.from_dict(body[name])
        else:
            extra = {"whitespace_pattern": body["guided_whitespace_pattern"]} if body.get(
                "guided_whitespace_pattern") else {}
            params = StructuredOutputsParams(**{_GUIDED[name]: body[name]}, **extra)
        if params is not None:  # (response_format "text" with other keys asks for nothing)
            compile_grammar(params)
    except (ValueError, TypeError) as e:
        raise APIError(str(e), param=name) from None
    return params


def sampling_params_from(body: dict, *, default_max_tokens: int | None, chat: bool = False) -> SamplingParams:
    """SamplingParams from an OpenAI body (with vLLM's extra fields); bad values raise APIError naming them."""
    reject_unsupported(body, chat=chat)
    max_tokens = get_field(body, "max_completion_tokens", (int,), None)
    if max_tokens is None:
        max_tokens = get_field(body, "max_tokens", (int,), default_max_tokens)
    stop = get_field(body, "stop", (str, list), None)
    kwargs = dict(
        n=get_field(body, "n", (int,), 1),
        temperature=get_field(body, "temperature", (int, float), 1.0),
        top_p=get_field(body, "top_p", (int, float), 1.0),
        top_k=get_field(body, "top_k", (int,), 0),
        seed=get_field(body, "seed", (int,), None),
        max_tokens=max_tokens,
        min_tokens=get_field(body, "min_tokens", (int,), 0),
        ignore_eos=get_field(body, "ignore_eos", (bool,), False),
        stop_token_ids=get_field(body, "stop_token_ids", (list,), []),
        stop=stop,
        include_stop_str_in_output=get_field(body, "include_stop_str_in_output", (bool,), False),
        skip_special_tokens=get_field(body, "skip_special_tokens", (bool,), True),
        spaces_between_special_tokens=get_field(body, "spaces_between_special_tokens", (bool,), True),
        logprobs=requested_logprobs(body, chat=chat),
        prompt_logprobs=get_field(body, "prompt_logprobs", (int,), None),
        repetition_penalty=get_field(body, "repetition_penalty", (int, float), 1.0),
        presence_penalty=get_field(body, "presence_penalty", (int, float), 0.0),
        frequency_penalty=get_field(body, "frequency_penalty", (int, float), 0.0),
        min_p=get_field(body, "min_p", (int, float), 0.0),
        logit_bias=get_field(body, "logit_bias", (dict,), None),
        allowed_token_ids=get_field(body, "allowed_token_ids", (list,), None),
        bad_words=get_field(body, "bad_words", (list,), None),
        structured_outputs=structured_outputs_from(body),
        truncate_prompt_tokens=get_field(body, "truncate_prompt_tokens", (int,), None),
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=param if param in kwargs else None) from None


def stream_usage(body: dict) -> tuple[bool, bool]:
    """From `stream_options`: include_usage (a last chunk with the request's usage) and vLLM's
    continuous_usage_stats (with include_usage: every chunk also carries its choice's usage so far)."""
    options = get_field(body, "stream_options", (dict,), {}) or {}
    include = bool(options.get("include_usage"))
    return include, include and bool(options.get("continuous_usage_stats"))


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (`--enable-prompt-tokens-details`)

    def to_dict(self) -> dict:
        out = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
               "total_tokens": self.prompt_tokens + self.completion_tokens}
        if self.cached_tokens is not None:
            out["prompt_tokens_details"] = {"cached_tokens": self.cached_tokens}
        return out


def _finite(logprob: float) -> float:
    """JSON has no -inf: a masked token's logprob is reported as -9999.0, as vLLM does."""
    return max(logprob, -9999.0)


def token_name(token_id: int, decoded: str | None, as_ids: bool) -> str:
    """How a token is named in logprobs: its text, or `token_id:N` (vLLM's `return_tokens_as_token_ids`,
    for tokens whose text is not valid UTF-8 on its own)."""
    return f"token_id:{token_id}" if as_ids else decoded or ""


def completion_logprobs(logprobs, token_ids: list[int], text_offset: int = 0, *, as_ids: bool = False,
                        first_text: str | None = None) -> dict:
    """The legacy completions `logprobs` object for these tokens (decoded strings, as vLLM); `text_offset`
    is where the first token's text starts in the choice's text. An entry of None (an echoed prompt's first
    token, which has no logprob) gets nulls, and `first_text` as its text."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for t, entry in zip(token_ids, logprobs):
        if entry is None:
            text = first_text or ""
            tokens.append(token_name(t, text, as_ids))
            token_logprobs.append(None)
            top.append(None)
        else:
            text = entry[t].decoded_token or ""
            tokens.append(token_name(t, text, as_ids))
            token_logprobs.append(_finite(entry[t].logprob))
            top.append({token_name(i, x.decoded_token, as_ids): _finite(x.logprob) for i, x in entry.items()})
        offsets.append(text_offset)
        text_offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def prompt_logprobs_json(entries) -> list | None:
    """vLLM's `prompt_logprobs` in JSON: null, then {token_id: {logprob, rank, decoded_token}} per token."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": _finite(x.logprob), "rank": x.rank,
                                             "decoded_token": x.decoded_token}
                                    for t, x in e.items()} for e in entries]


def chat_logprobs(logprobs, token_ids: list[int], k: int, *, as_ids: bool = False) -> dict | None:
    """The chat `logprobs` object for one delta: `content` entries with `top_logprobs`."""
    if logprobs is None:
        return None

    def item(token_id, lp):
        text = lp.decoded_token or ""
        return {"token": token_name(token_id, text, as_ids), "logprob": _finite(lp.logprob),
                "bytes": list(text.encode("utf-8", "replace"))}

    content = []
    for t, e in zip(token_ids, logprobs):
        top = sorted(((i, x) for i, x in e.items() if x.rank is not None and x.rank <= k), key=lambda ix: ix[1].rank)
        content.append({**item(t, e[t]), "top_logprobs": [item(i, x) for i, x in top[:k]]})
    return {"content": content}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

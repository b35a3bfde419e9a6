"""OpenAI request validation (into `SamplingParams`) and response shapes."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from jaxpaged.sampling_params import SamplingParams


class APIError(Exception):
    """An error answered as OpenAI's JSON error body."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 err_type: str = "BadRequestError"):
        super().__init__(message)
        self.message, self.status, self.param, self.err_type = message, status, param, err_type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param,
                          "code": self.status}}


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


def sampling_params_from(body: dict, *, default_max_tokens: int | None, chat: bool = False) -> SamplingParams:
    """SamplingParams from an OpenAI body (with vLLM's extra fields); bad values raise APIError naming them."""
    if body.get("echo"):
        raise APIError("'echo' is not supported", param="echo")
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
    )
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        param = str(e).split(" ", 1)[0]
        raise APIError(str(e), param=param if param in kwargs else None) from None


@dataclass
class Usage:
    prompt_tokens: int
    completion_tokens: int

    def to_dict(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def completion_logprobs(logprobs, token_ids: list[int], tokenizer) -> dict | None:
    """The legacy completions `logprobs` object for one delta."""
    if logprobs is None:
        return None
    tokens = tokenizer.convert_ids_to_tokens(token_ids)
    return {"tokens": tokens, "token_logprobs": [e[t].logprob for t, e in zip(token_ids, logprobs)],
            "top_logprobs": [{x.decoded_token: x.logprob for x in e.values()} for e in logprobs],
            "text_offset": []}


def prompt_logprobs_json(entries) -> list | None:
    """vLLM's `prompt_logprobs` in JSON: null, then {token_id: {logprob, rank, decoded_token}} per token."""
    if entries is None:
        return None
    return [None if e is None else {str(t): {"logprob": x.logprob, "rank": x.rank, "decoded_token": x.decoded_token}
                                    for t, x in e.items()} for e in entries]


def chat_logprobs(logprobs, token_ids: list[int], k: int) -> dict | None:
    """The chat `logprobs` object for one delta: `content` entries with `top_logprobs`."""
    if logprobs is None:
        return None

    def item(lp):
        tok = lp.decoded_token or ""
        return {"token": tok, "logprob": lp.logprob, "bytes": list(tok.encode("utf-8", "replace"))}

    content = []
    for t, e in zip(token_ids, logprobs):
        top = sorted((x for x in e.values() if x.rank is not None and x.rank <= k), key=lambda x: x.rank)
        content.append({**item(e[t]), "top_logprobs": [item(x) for x in top[:k]]})
    return {"content": content}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

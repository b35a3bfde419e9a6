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


# Fields that vLLM accepts and this engine does not implement yet: refused unless neutral.
_NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1, "min_p": 0,
            "logprobs": None, "top_logprobs": None, "prompt_logprobs": None, "logit_bias": None}


def sampling_params_from(body: dict, *, default_max_tokens: int | None) -> SamplingParams:
    """SamplingParams from an OpenAI body (with vLLM's extra fields); bad values raise APIError naming them."""
    for name, neutral in _NEUTRAL.items():
        value = body.get(name)
        if value not in (None, neutral, False) and not (name == "logprobs" and value is False):
            raise APIError(f"'{name}' is not supported by this server yet", param=name)
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())

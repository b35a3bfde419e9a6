"""`SamplingParams`: how one request picks its tokens and when it stops. Validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

MAX_LOGPROBS = 20
SEED_RANGE = (-(2**63), 2**63)  # vLLM's (a 64-bit signed integer)
FLOAT32_MAX = float(np.finfo(np.float32).max)  # settings reach the device as float32: larger would be inf there
GREEDY_BELOW = 1e-5  # a temperature under this samples as greedy (vLLM's _SAMPLING_EPS): 1/T would overflow


def row_seed(seed: int) -> int:
    """The 32-bit seed a request's row samples with: `seed` itself in [0, 2**32), other 64-bit seeds hashed
    into that range (NumPy's SeedSequence)."""
    if 0 <= seed < 2**32:
        return seed
    return int(np.random.SeedSequence(seed % 2**64).generate_state(1)[0])


@dataclass
class StructuredOutputsParams:
    """A constraint on the output, with vLLM's names: exactly one of json (a JSON schema, as a dict or its
    text), regex, choice (the output is one of these strings), grammar (Lark, or GBNF/EBNF as llama.cpp
    writes it) or json_object (any JSON object). disable_any_whitespace: compact JSON (the default here
    already; kept for vLLM's API). whitespace_pattern: a regex for the whitespace JSON may use.
    reasoning_end: a reasoning model's thinking comes first, free, up to and including this text (`</think>`),
    then the constrained answer; with reasoning_start as well (`<think>`) the reply thinks only if it begins
    with that text, else it begins inside the thinking.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    whitespace_pattern: str | None = None
    reasoning_start: str | None = None
    reasoning_end: str | None = None

    KINDS = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise ValueError("structured_outputs needs exactly one of json, regex, choice, grammar, json_object; "
                             f"got {', '.join(given) or 'none'}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise ValueError(f"structured_outputs.json must be a JSON schema (dict or string), got "
                             f"{type(self.json).__name__}")
        if self.reasoning_start is not None and self.reasoning_end is None:
            raise ValueError("structured_outputs.reasoning_start needs reasoning_end")
        for name in ("regex", "grammar", "whitespace_pattern", "reasoning_start", "reasoning_end"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured_outputs.{name} must be a non-empty string, got {v!r}")
        if self.choice is not None and (not isinstance(self.choice, (list, tuple)) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError(f"structured_outputs.choice must be a non-empty list of non-empty strings, "
                             f"got {self.choice!r}")
        if self.json_object not in (None, True, False):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @classmethod
    def from_dict(cls, d: dict) -> StructuredOutputsParams:
        """From a request's JSON object; unknown keys raise ValueError naming them."""
        if not isinstance(d, dict):
            raise ValueError(f"structured_outputs must be an object, got {type(d).__name__}")
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"structured_outputs has unknown fields {unknown}")
        return cls(**d)


@dataclass
class SamplingParams:
    """Per-request sampling settings, with vLLM's names and meanings.

    temperature 0 means greedy. top_k 0 (or -1) and top_p 1 mean off. A bad value raises
    ValueError naming the field.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] | str | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True  # honoured by slow tokenizers; fast ones space by their decoder
    logprobs: int | None = None  # top-k alternatives per generated token (0: only the sampled token)
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    repetition_penalty: float = 1.0  # > 1 discourages tokens seen in the prompt or output
    presence_penalty: float = 0.0  # subtracted once from tokens already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    min_p: float = 0.0  # drop tokens below min_p * the top token's probability
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (clamped to [-100, 100])
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words never generated (their single-token forms are masked)
    structured_outputs: StructuredOutputsParams | None = None  # constrain the output (JSON schema, regex...)
    truncate_prompt_tokens: int | None = None  # keep only the prompt's last k tokens (-1: max_model_len)

    def __post_init__(self) -> None:
        self._check_int("n", minimum=1)
        if (not isinstance(self.temperature, (int, float)) or isinstance(self.temperature, bool)
                or not math.isfinite(self.temperature) or not 0 <= self.temperature <= FLOAT32_MAX):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k == -1:
            self.top_k = 0
        self._check_int("top_k", minimum=0)
        if self.seed is not None:
            self._check_int("seed", minimum=SEED_RANGE[0])
            if self.seed >= SEED_RANGE[1]:
                raise ValueError(f"seed must be a 64-bit integer (< 2**63), got {self.seed!r}")
        if self.max_tokens is not None:
            self._check_int("max_tokens", minimum=1)
        self._check_int("min_tokens", minimum=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if not isinstance(self.stop_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in self.stop_token_ids
        ):
            raise ValueError(f"stop_token_ids must be a list of non-negative ints, got {self.stop_token_ids!r}")
        self.stop_token_ids = list(self.stop_token_ids)
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        if not all(isinstance(x, str) and x for x in self.stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {self.stop!r}")
        if self.logprobs is not None:
            self._check_int("logprobs", minimum=0)
            if self.logprobs > MAX_LOGPROBS:
                raise ValueError(f"logprobs must be <= {MAX_LOGPROBS}, got {self.logprobs}")
        if self.prompt_logprobs is not None:
            self._check_int("prompt_logprobs", minimum=0)
            if self.prompt_logprobs > MAX_LOGPROBS:
                raise ValueError(f"prompt_logprobs must be <= {MAX_LOGPROBS}, got {self.prompt_logprobs}")
        self._check_float("repetition_penalty", lo=0.0, lo_open=True)
        self._check_float("presence_penalty", lo=-2.0, hi=2.0)
        self._check_float("frequency_penalty", lo=-2.0, hi=2.0)
        self._check_float("min_p", lo=0.0, hi=1.0)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, dict):
                raise ValueError(f"logit_bias must be a dict of token id -> bias, got {type(self.logit_bias).__name__}")
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError):
                raise ValueError("logit_bias must map integer token ids to numbers") from None
            if not all(math.isfinite(v) for v in bias.values()):
                raise ValueError("logit_bias values must be finite numbers")
            self.logit_bias = {k: max(-100.0, min(100.0, v)) for k, v in bias.items()}
        if self.allowed_token_ids is not None:
            if not self.allowed_token_ids or not all(isinstance(t, int) and t >= 0 for t in self.allowed_token_ids):
                raise ValueError("allowed_token_ids must be a non-empty list of non-negative ints")
        if self.bad_words is not None and not all(isinstance(w, str) and w for w in self.bad_words):
            raise ValueError("bad_words must be a list of non-empty strings")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise ValueError("structured_outputs must be a StructuredOutputsParams, got "
                             f"{type(self.structured_outputs).__name__}")
        k = self.truncate_prompt_tokens
        if k is not None and (not isinstance(k, int) or isinstance(k, bool) or not (k == -1 or k >= 1)):
            raise ValueError(f"truncate_prompt_tokens must be an integer >= 1, or -1, got {k!r}")
        self.temperature = float(self.temperature)
        self.top_p = float(self.top_p)

    def truncated(self, prompt_ids: list[int], max_model_len: int) -> list[int]:
        """The prompt as the request uses it: with `truncate_prompt_tokens` k, its last k tokens (vLLM's left
        truncation; -1: the last max_model_len)."""
        k = self.truncate_prompt_tokens
        if k is None:
            return prompt_ids
        k = max_model_len if k == -1 else k
        return prompt_ids[-k:] if len(prompt_ids) > k else prompt_ids

    def _check_float(self, name: str, *, lo: float, hi: float = FLOAT32_MAX, lo_open: bool = False) -> None:
        v = getattr(self, name)
        if (not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v)
                or not (lo < v if lo_open else lo <= v) or v > hi):
            raise ValueError(f"{name} must be a finite number in {'(' if lo_open else '['}{lo}, {hi:g}], got {v!r}")
        setattr(self, name, float(v))

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    @property
    def needs_bias_row(self) -> bool:
        return bool(self.logit_bias) or self.allowed_token_ids is not None or bool(self.bad_words)

    def _check_int(self, name: str, *, minimum: int) -> None:
        v = getattr(self, name)
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
            raise ValueError(f"{name} must be an integer >= {minimum}, got {v!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

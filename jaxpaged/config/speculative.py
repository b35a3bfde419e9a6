"""`SpeculativeConfig`: vLLM's `speculative_config` dict, validated before the model loads."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

METHODS = ("ngram", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_LOOKUP = 5  # prompt_lookup_min/max when neither is given (vLLM's)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's names). method "ngram": propose the `num_speculative_tokens` tokens that
    followed the most recent earlier occurrence of the request's last n tokens, trying n from prompt_lookup_max
    down to prompt_lookup_min. method "draft_model": a smaller model sharing the tokenizer (`model`, an HF folder
    or GGUF file, loaded like the target) proposes them greedily, inside the target's step
    (spec_decode/draft_model.py)."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = DEFAULT_LOOKUP
    prompt_lookup_min: int = DEFAULT_LOOKUP
    # jaxpaged's own key: verify only the drafts that raise the step's tokens per second (spec_decode/budget.py);
    # False: every proposed draft, as vLLM does
    adaptive: bool = True
    model: str | None = None  # the draft model's path (method "draft_model")

    @classmethod
    def from_user(cls, value: dict[str, Any] | str | SpeculativeConfig | None) -> SpeculativeConfig | None:
        """Parse `speculative_config` (a dict, or its JSON text from the CLI); ValueError names the bad key."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config: not valid JSON ({e.msg}): {value!r}") from None
        if not isinstance(value, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {type(value).__name__}")
        known = {"method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "adaptive", "model"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {unknown}")
        model = value.get("model")
        if model in ("[ngram]", "ngram"):  # (vLLM's older spelling of the n-gram method)
            value = {k: v for k, v in value.items() if k != "model"}
            value.setdefault("method", "ngram")
            model = None
        if isinstance(model, os.PathLike):
            model = os.fspath(model)
        method = value.get("method", "draft_model" if model is not None else "ngram")  # (vLLM infers it so)
        if method == "[ngram]":
            method = "ngram"
        if method not in METHODS:
            raise ValueError(f"speculative_config.method must be one of {', '.join(METHODS)}, got {method!r}")
        if method == "draft_model" and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config.model: method 'draft_model' needs the draft model's path, "
                             f"got {model!r}")
        if method == "ngram" and model is not None:
            raise ValueError("speculative_config.model: method 'ngram' takes no model (use method 'draft_model')")
        if method == "draft_model":
            for name in ("prompt_lookup_min", "prompt_lookup_max"):
                if name in value:
                    raise ValueError(f"speculative_config.{name} applies to method 'ngram' only")
        if "num_speculative_tokens" not in value:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        k = value["num_speculative_tokens"]
        if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config.num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        lo, hi = value.get("prompt_lookup_min"), value.get("prompt_lookup_max")
        for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"speculative_config.{name} must be a positive integer, got {v!r}")
        if lo is None and hi is None:  # vLLM's defaults; either bound alone sets both
            lo = hi = DEFAULT_LOOKUP
        lo, hi = lo if lo is not None else hi, hi if hi is not None else lo
        if lo > hi:
            raise ValueError(f"speculative_config.prompt_lookup_min ({lo}) exceeds prompt_lookup_max ({hi})")
        adaptive = value.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"speculative_config.adaptive must be true or false, got {adaptive!r}")
        return cls(method, k, hi, lo, adaptive, model)

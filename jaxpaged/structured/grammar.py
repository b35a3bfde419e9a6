"""`compile_grammar`: a request's `StructuredOutputsParams` as an llguidance grammar, checked against the
tokenizer, or a ValueError naming the field and what is wrong (unsupported JSON-schema keys included).
llguidance is imported when a grammar is first built, so the engine imports without it (the GPU machine has
none; a fresh install always does)."""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING

from jaxpaged.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from llguidance import LLTokenizer


def _json_options(p: StructuredOutputsParams) -> dict:
    """Compact JSON (no free whitespace: small models can loop on it) unless a whitespace_pattern is given;
    oneOf read as anyOf (what schemas from pydantic mean)."""
    options: dict = {"whitespace_flexible": False, "coerce_one_of": True}
    if p.whitespace_pattern is not None:
        options["whitespace_pattern"] = p.whitespace_pattern
    return options


def _llguidance():
    """The llguidance module, or a ValueError naming the field (a request's error, not a server's crash)."""
    try:
        import llguidance
        import llguidance.gbnf_to_lark
    except ImportError:
        raise ValueError("structured_outputs needs llguidance, which is not installed here "
                         "(`pip install llguidance`, a dependency of jaxpaged)") from None
    return llguidance


def grammar_source(p: StructuredOutputsParams, tokenizer: LLTokenizer | None = None) -> str:
    """The llguidance grammar text for `p` (not yet validated), after a reasoning model's free thinking when
    `p.reasoning_end` is set."""
    answer = _answer_source(p)
    if p.reasoning_end is None:
        return answer
    end, end_is_token = _literal(p.reasoning_end, tokenizer)
    # the thinking: free text up to its end tag; a tag the tokenizer holds as one special token is that token
    # (which no text matches), else the text, ending a lazy lexeme at its first occurrence
    think = "think: /(?s:.*)/" if end_is_token else f"think[lazy]: /(?s:.*)/ {end}"
    opened = f"think {end} WS?" if end_is_token else "think WS?"
    if p.reasoning_start is not None:
        opened = f"({_literal(p.reasoning_start, tokenizer)[0]} {opened})?"
    lark = f"start: {opened} @answer\n{think}\nWS: /[ \\t\\r\\n]+/\n"
    try:  # (a grammar list in JSON, or, from Lark, the Lark text itself)
        inner = json.loads(answer)["grammars"]
    except (json.JSONDecodeError, TypeError, KeyError):
        inner = [{"lark_grammar": answer}]
    inner = [{**g, "name": "answer"} if i == 0 else g for i, g in enumerate(inner)]
    return json.dumps({"grammars": [{"name": "reasoning", "lark_grammar": lark}, *inner]})


def _literal(text: str, tokenizer: LLTokenizer | None) -> tuple[str, bool]:
    """`text` in Lark: the special token it is (`<[id]>`: Qwen3's and DeepSeek's </think> are added tokens, which
    the grammar engine reads as special), or the quoted text; and whether it is a token."""
    if tokenizer is not None:
        ids = tokenizer.tokenize_str(text)
        if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
            return f"<[{ids[0]}]>", True
    return json.dumps(text), False


def _answer_source(p: StructuredOutputsParams) -> str:
    llguidance = _llguidance()
    LLMatcher, any_to_lark = llguidance.LLMatcher, llguidance.gbnf_to_lark.any_to_lark

    kind = p.kind
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else p.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if not isinstance(schema, dict):
            raise ValueError(f"structured_outputs.json must be a JSON object (a schema), got {type(schema).__name__}")
        return LLMatcher.grammar_from_json_schema(schema, overrides=_json_options(p))
    if kind == "regex":
        return LLMatcher.grammar_from_regex(p.regex)
    if kind == "choice":
        return LLMatcher.grammar_from_regex("|".join(f"(?:{re.escape(c)})" for c in p.choice))
    try:
        return LLMatcher.grammar_from_lark(any_to_lark(p.grammar))
    except Exception as e:  # the GBNF converter raises on text it cannot read
        raise ValueError(f"structured_outputs.grammar could not be read: {e}") from None


def compile_grammar(p: StructuredOutputsParams, tokenizer: LLTokenizer | None = None) -> str:
    """Validated grammar text for `p`; ValueError naming `structured_outputs.<kind>` when it is unusable."""
    source = grammar_source(p, tokenizer)
    is_error, messages = _llguidance().LLMatcher.validate_grammar_with_warnings(source, tokenizer)
    if is_error:
        message = messages[0].strip().splitlines()[0] if messages else "invalid"
        raise ValueError(f"structured_outputs.{p.kind} is not supported: {message}")
    return source

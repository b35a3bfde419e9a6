"""One chat choice's text, as it is generated, split into what OpenAI's message carries: `reasoning_content`
(a reasoning parser's thinking), `content`, and `tool_calls` (a tool parser's, or the forced calls of tool_choice
"required" or a named function). A stream sends each `feed`'s delta; a non-streamed answer is the same parser fed
the whole text, so the two always agree."""

from __future__ import annotations

import json
import secrets
import string
import uuid

from server.reasoning import ReasoningParser
from server.tool_parsers import ParsedDelta, ToolParser

_ALNUM = string.ascii_letters + string.digits


def new_call_id(style: str) -> str:
    """A tool call's id: OpenAI's `call_...`, or the 9 letters and digits Mistral's templates require."""
    return "".join(secrets.choice(_ALNUM) for _ in range(9)) if style == "mistral" else f"call_{uuid.uuid4().hex[:24]}"


class ChoiceParser:
    def __init__(self, *, reasoning: ReasoningParser | None = None, tools: ToolParser | None = None,
                 parallel: bool = True) -> None:
        self.reasoning_parser, self.tool_parser = reasoning, tools
        self.parallel = parallel  # parallel_tool_calls: without it, calls after the first are dropped
        self.reasoning = self.content = ""
        self.answer = ""  # the text after the thinking, as the tool parser read it
        self.calls: list[dict] = []  # OpenAI's tool_calls objects so far

    def feed(self, text: str, final: bool = False) -> dict:
        """The delta's fields for this piece of text (empty when it is held back, e.g. a tag's beginning);
        `final`: the choice ends with it (what was held back comes too)."""
        delta: dict = {}
        if self.reasoning_parser is not None:
            r = self.reasoning_parser.feed(text)
            if final:
                rest = self.reasoning_parser.finish()
                r.reasoning, r.content = r.reasoning + rest.reasoning, r.content + rest.content
            if r.reasoning:
                self.reasoning += r.reasoning
                delta["reasoning_content"] = r.reasoning
            text = r.content
        return delta | self._tools(text, final)

    def _tools(self, text: str, final: bool) -> dict:
        self.answer += text
        if self.tool_parser is None:
            self.content += text
            return {"content": text} if text else {}
        parsed: ParsedDelta = self.tool_parser.feed(text)
        if final:
            rest = self.tool_parser.finish()
            parsed.content, parsed.calls = parsed.content + rest.content, parsed.calls + rest.calls
        delta: dict = {}
        if parsed.content:
            self.content += parsed.content
            delta["content"] = parsed.content
        entries: dict[int, dict] = {}
        for c in parsed.calls:
            if c.index > 0 and not self.parallel:
                continue
            if c.index == len(self.calls):
                self.calls.append({"id": new_call_id(self.tool_parser.id_style), "type": "function",
                                   "function": {"name": c.name, "arguments": ""}})
                entries[c.index] = {"index": c.index, "id": self.calls[-1]["id"], "type": "function",
                                    "function": {"name": c.name, "arguments": ""}}
            entry = entries.setdefault(c.index, {"index": c.index, "function": {"arguments": ""}})
            entry["function"]["arguments"] += c.arguments
            self.calls[c.index]["function"]["arguments"] += c.arguments
        if final and not self.tool_parser.forced:  # a call written without arguments gets an empty object (a
            # forced call without them was cut short: it is not whole, and not made up)
            for i, call in enumerate(self.calls):
                if not call["function"]["arguments"]:
                    call["function"]["arguments"] = "{}"
                    entries.setdefault(i, {"index": i, "function": {"arguments": ""}})["function"]["arguments"] = "{}"
        if entries:
            delta["tool_calls"] = [entries[i] for i in sorted(entries)]
        return delta

    def message(self, role: str, prefix: str = "") -> dict:
        """The non-streamed message, after the final `feed`. A free reply whose calls do not all hold JSON
        arguments (the parser misread it) is content, as vLLM answers it; a forced reply cut short (max_tokens)
        keeps its whole calls."""
        calls = self.calls
        content = prefix + self.content
        parser = self.tool_parser
        if parser is not None and parser.forced:
            calls = [c for c in calls if _is_json(c["function"]["arguments"])]
        elif parser is not None and ((calls and not all(_is_json(c["function"]["arguments"]) for c in calls))
                                     or (parser.in_calls and not calls)):
            calls, content = [], prefix + self.answer
        if calls and not content.strip():
            content = ""
        out: dict = {"role": role, "content": content if content or not (calls or self.reasoning) else None}
        if self.reasoning_parser is not None:
            out["reasoning_content"] = self.reasoning or None
        if calls:
            out["tool_calls"] = calls
        return out


def _is_json(text: str) -> bool:
    """Whether `text` is a JSON object (what a call's arguments are)."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):  # (JSONDecodeError, digits past Python's limit, nesting past its stack)
        return False

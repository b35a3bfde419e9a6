"""Pythonic calls (Llama 3.2 and 4, ToolACE and others): the reply is a Python list of calls with keyword
arguments, `[get_weather(city="Paris"), get_time(zone="CET")]`, optionally inside `<|python_start|>` ...
`<|python_end|>`. A reply that does not begin so is all content. Each call is sent whole once its closing
parenthesis arrives (its arguments as JSON: Python literals read with `ast.literal_eval`)."""

from __future__ import annotations

import ast
import json

from server.tool_parsers.base import CallDelta, ParsedDelta, ToolParser

_OPENERS, _CLOSERS = "([{", ")]}"


class PythonicToolParser(ToolParser):
    TAG = "<|python_start|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start -> content, or start -> list (-> rest: dropped)
        self._item = ""  # the call being read, from its name
        self._depth = 0  # brackets open inside the list
        self._quote: str | None = None
        self._escaped = False
        self._calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        if self._mode == "start":
            head = self._buf.lstrip()
            head = head[len(self.TAG):].lstrip() if head.startswith(self.TAG) else head
            if head.startswith("["):
                self._buf, self._mode, self.in_calls = head[1:], "list", True
            elif not final and (not head or self.TAG.startswith(head)):
                return out
            else:
                self._mode = "content"
        if self._mode == "content":
            out.content, self._buf = self._buf, ""
        elif self._mode == "list":
            text, self._buf = self._buf, ""
            for ch in text:
                if self._read(ch, out):
                    self._mode = "rest"
                    break
        else:
            self._buf = ""
        return out

    def _read(self, ch: str, out: ParsedDelta) -> bool:
        """One character inside the list; True at the list's closing bracket."""
        if self._quote is not None:
            self._item += ch
            if self._escaped:
                self._escaped = False
            elif ch == "\\":
                self._escaped = True
            elif ch == self._quote:
                self._quote = None
            return False
        if self._depth == 0 and ch in ",]":
            self._end_item(out)
            return ch == "]"
        if ch in "'\"":
            self._quote = ch
        elif ch in _OPENERS:
            self._depth += 1
        elif ch in _CLOSERS:
            self._depth -= 1
        self._item += ch
        if self._depth == 0 and ch == ")":
            self._end_item(out)
        return False

    def _end_item(self, out: ParsedDelta) -> None:
        item, self._item = self._item.strip(), ""
        if not item:
            return
        call = _parse_call(item)
        if call is not None:
            out.calls.append(CallDelta(self._calls, name=call[0], arguments=call[1]))
            self._calls += 1


def _parse_call(text: str) -> tuple[str, str] | None:
    """`name(key=literal, ...)` -> (name, the arguments as JSON), or None when it is not such a call."""
    try:
        node = ast.parse(text, mode="eval").body
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            return None
        args = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg is not None}
        if len(args) != len(node.keywords):
            return None
        return node.func.id, json.dumps(args, ensure_ascii=False)
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None

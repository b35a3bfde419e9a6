"""Llama 3.1/3.2 JSON calls: the reply is the call itself, `{"name": ..., "parameters": {...}}`, optionally after
`<|python_tag|>`, several separated by `;`. A reply that does not begin so is all content."""

from __future__ import annotations

from server.tool_parsers.base import JsonCallReader, ParsedDelta, ToolParser


class Llama3JsonToolParser(ToolParser):
    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "start"  # start -> content, or start -> call -> between -> call ... (-> rest: dropped)
        self._call: JsonCallReader | None = None
        self._calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._mode == "start":
                head = self._buf.lstrip()
                if head.startswith(self.TAG):
                    self._buf, self._mode, self.in_calls = head[len(self.TAG):], "between", True
                elif head.startswith("{"):
                    self._buf, self._mode, self.in_calls = head, "between", True
                elif not final and self.TAG.startswith(head):  # (nothing yet, or the tag's beginning)
                    return out
                else:
                    self._mode = "content"
            elif self._mode == "content":
                out.content, self._buf = self._buf, ""
                return out
            elif self._mode == "between":  # before a call: whitespace and `;` separators
                head = self._buf.lstrip().lstrip(";")
                while head != (head := head.lstrip().lstrip(";")):
                    pass
                if not head:
                    self._buf = ""
                    return out
                self._buf = head
                self._mode, self._call = ("call", JsonCallReader()) if head[0] == "{" else ("rest", None)
            elif self._mode == "call":
                used = self._call.feed(self._buf)
                self._buf = self._buf[used:]
                out.calls += self._call.deltas(self._calls)
                if not (self._call.done or self._call.failed):
                    return out
                if self._call.name is not None:
                    self._calls += 1
                self._mode = "between" if self._call.done else "rest"
            else:
                self._buf = ""
                return out

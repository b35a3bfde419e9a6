"""Hermes-style calls (Qwen2.5, Qwen3, Hermes 2/3, many others): `<tool_call>{"name": ..., "arguments": {...}}
</tool_call>` (or a JSON list of such objects inside one tag), any number of them; the text before the first is the content (text between and after calls is
dropped, as vLLM's parser does)."""

from __future__ import annotations

from server.tool_parsers.base import (
    JsonCallList,
    JsonCallReader,
    ParsedDelta,
    ToolParser,
    held_back,
)


class HermesToolParser(ToolParser):
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "content"  # content -> opened -> call | list -> skip (to the closing tag) -> content ...
        self._call: JsonCallReader | None = None
        self._list: JsonCallList | None = None
        self._calls = 0  # calls named so far

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            if self._mode == "content":
                k = self._buf.find(self.OPEN)
                if k < 0:
                    keep = 0 if final else held_back(self._buf, self.OPEN)
                    if not self.in_calls:
                        out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if not self.in_calls:
                    out.content += self._buf[:k]
                self._buf, self._mode, self.in_calls = self._buf[k + len(self.OPEN):], "opened", True
            elif self._mode == "opened":  # an object, or a list of them
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return out
                if self._buf[0] == "[":
                    self._mode, self._list = "list", JsonCallList(self._calls)
                else:
                    self._mode, self._call = "call", JsonCallReader()
            elif self._mode == "list":
                used, calls = self._list.feed(self._buf)
                self._buf = self._buf[used:]
                out.calls += calls
                if not (self._list.done or self._list.failed):
                    return out
                self._calls += self._list.count
                self._mode = "skip"
            elif self._mode == "call":
                used = self._call.feed(self._buf)
                self._buf = self._buf[used:]
                out.calls += self._call.deltas(self._calls)
                if not (self._call.done or self._call.failed):
                    return out
                if self._call.name is not None:
                    self._calls += 1
                self._mode = "skip"
            else:  # past a call's object, to its closing tag
                k = self._buf.find(self.CLOSE)
                if k < 0:
                    keep = 0 if final else held_back(self._buf, self.CLOSE)
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                self._buf, self._mode = self._buf[k + len(self.CLOSE):], "content"

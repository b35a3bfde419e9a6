"""Mistral calls: content, then `[TOOL_CALLS]` and a JSON list of `{"name": ..., "arguments": {...}}`; or, as the
newer (v11) tokenizers write them, `[TOOL_CALLS]name[ARGS]{...}` once per call (`name[CALL_ID]id[ARGS]` in the newest). Call ids are 9 letters and
digits, as Mistral's chat templates require. `[TOOL_CALLS]` is a special token: the server keeps special tokens
in the text for this parser."""

from __future__ import annotations

from server.tool_parsers.base import (
    CallDelta,
    JsonCallList,
    JsonValueReader,
    ParsedDelta,
    ToolParser,
    held_back,
)


class MistralToolParser(ToolParser):
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"
    id_style = "mistral"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = "content"  # content -> after_tag -> list -> content, or after_tag -> name -> args -> content
        self._list: JsonCallList | None = None
        self._args: JsonValueReader | None = None
        self._args_sent = 0  # of the v11 arguments' text
        self._calls = 0

    def feed(self, text: str) -> ParsedDelta:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> ParsedDelta:
        return self._run(final=True)

    def _run(self, final: bool) -> ParsedDelta:
        out = ParsedDelta()
        while True:
            mode = self._mode
            if mode == "content":
                k = self._buf.find(self.TAG)
                if k < 0:
                    keep = 0 if final else held_back(self._buf, self.TAG)
                    if not self.in_calls:
                        out.content += self._buf[: len(self._buf) - keep]
                    self._buf = self._buf[len(self._buf) - keep:]
                    return out
                if not self.in_calls:
                    out.content += self._buf[:k]
                self._buf, self._mode, self.in_calls = self._buf[k + len(self.TAG):], "after_tag", True
            elif mode == "after_tag":
                head = self._buf.lstrip()
                if not head:
                    self._buf = ""
                    return out
                self._buf = head
                self._mode = "list" if head[0] in "[{" else "name"  # (a lone object: a list without brackets)
                self._list = JsonCallList(self._calls, opened=head[0] == "{") if head[0] in "[{" else None
            elif mode == "list":
                used, calls = self._list.feed(self._buf)
                self._buf = self._buf[used:]
                out.calls += calls
                if not (self._list.done or self._list.failed):
                    return out
                self._calls += self._list.count
                self._mode = "content"
            elif mode == "name":  # v11: the name, up to [ARGS]
                k = self._buf.find(self.ARGS)
                if k < 0:
                    if final:
                        self._buf = ""
                    return out
                name = self._buf[:k].split("[CALL_ID]", 1)[0].strip()  # (newer tokenizers write an id there)
                self._buf, self._mode, self._args = self._buf[k + len(self.ARGS):], "args", JsonValueReader()
                self._args_sent = 0
                out.calls.append(CallDelta(self._calls, name=name))
            else:  # v11 arguments: one JSON value
                self._buf = self._buf[self._args.feed(self._buf):]
                piece, self._args_sent = self._args.text[self._args_sent:], len(self._args.text)
                if piece:
                    out.calls.append(CallDelta(self._calls, arguments=piece))
                if not self._args.done:
                    return out
                self._calls += 1
                self._mode = "content"

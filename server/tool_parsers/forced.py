"""The replies of tool_choice "required" and a named function, which the grammar engine has constrained to calls:
a JSON list of `{"name", "parameters"}` objects, or the named function's arguments as the whole reply."""

from __future__ import annotations

from server.tool_parsers.base import CallDelta, JsonCallList, ParsedDelta, ToolParser


class RequiredCallsParser(ToolParser):
    forced = True

    def __init__(self) -> None:
        self._list = JsonCallList()

    def feed(self, text: str) -> ParsedDelta:
        return ParsedDelta(calls=self._list.feed(text)[1])


class NamedCallParser(ToolParser):
    forced = True

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> ParsedDelta:
        if not self._started:
            text = text.lstrip()  # (nothing is sent before the arguments begin: after a thinking, say)
        if not text:
            return ParsedDelta()
        delta = CallDelta(0, name=None if self._started else self.name, arguments=text)
        self._started = True
        return ParsedDelta(calls=[delta])

"""What a tool parser reads and says: a choice's text as the model writes it, in pieces of any size; the
content meant for the user, and the tool calls in the pieces OpenAI streams them in (a call's name once, then
its arguments' JSON text as it arrives). The same parser reads a whole text at once for a non-streamed answer,
so a stream's pieces always add up to the non-streamed message."""

from __future__ import annotations

import json
from dataclasses import dataclass, field


@dataclass
class CallDelta:
    """A piece of call `index` of a choice: its name in the call's first piece, then pieces of its arguments."""

    index: int
    name: str | None = None
    arguments: str = ""


@dataclass
class ParsedDelta:
    content: str = ""
    calls: list[CallDelta] = field(default_factory=list)


class ToolParser:
    """Reads a choice's text a piece at a time (`feed`), then `finish` once it ends; each returns what is new."""

    id_style = "openai"  # how its calls' ids look: "call_<24 hex>", or mistral's 9 letters and digits
    forced = False  # reads a reply the grammar made calls (tool_choice "required" or a named function)
    in_calls = False  # the reply has begun a call (a free reply that then yields none is content after all)

    def feed(self, text: str) -> ParsedDelta:
        raise NotImplementedError

    def finish(self) -> ParsedDelta:
        return ParsedDelta()


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (kept until the next piece)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class JsonValueReader:
    """One JSON value's text read a piece at a time, without parsing it: where it ends (brackets and strings
    counted) is all that is known. A bare number or literal ends at the character after it."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self._depth, self._in_string, self._escaped = 0, False, False

    def feed(self, text: str) -> int:
        """Reads up to the value's end; returns the characters used (whitespace before it included)."""
        for i, ch in enumerate(text):
            if self._in_string:
                self.text += ch
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
                    if self._depth == 0:
                        self.done = True
                        return i + 1
            elif ch.isspace() and not self.text:
                continue
            elif ch in "{[":
                self._depth += 1
                self.text += ch
            elif ch in "}]" and self._depth > 0:
                self._depth -= 1
                self.text += ch
                if self._depth == 0:
                    self.done = True
                    return i + 1
            elif ch == '"':
                self._in_string = True
                self.text += ch
            elif self._depth == 0 and (ch in ",}]" or ch.isspace()):  # (the end of a bare number or literal)
                self.done = bool(self.text)
                return i
            else:
                self.text += ch
        return len(text)


class JsonCallReader:
    """One call written as a JSON object, `{"name": "f", "arguments": {...}}` ("parameters" also read as the
    arguments, keys in either order), read a piece at a time. `failed` once the text cannot be such an object."""

    ARGUMENT_KEYS = ("arguments", "parameters")

    def __init__(self) -> None:
        self.name: str | None = None
        self.arguments = ""  # the arguments' JSON text so far
        self.done = self.failed = False
        self._state = "start"  # start -> key -> colon -> value -> after -> key ... -> done
        self._key = ""
        self._value: JsonValueReader | None = None
        self._sent_name, self._sent_arguments = False, 0
        self._arguments_done = False

    def feed(self, text: str) -> int:
        """Reads up to the object's closing brace; returns the characters used."""
        i = 0
        while i < len(text) and not (self.done or self.failed):
            ch = text[i]
            if self._state == "value":
                used = self._value.feed(text[i:])
                i += used
                if self._value.done:
                    self._end_value()
                elif self._key in self.ARGUMENT_KEYS and not self._arguments_done:
                    self.arguments = self._value.text
                if used == 0 and not self._value.done:
                    self.failed = True
                continue
            i += 1
            if self._state == "key_text":
                self._key += ch
                if ch == '"' and not _ends_escaped(self._key[:-1]):
                    try:
                        self._key = json.loads('"' + self._key)
                    except json.JSONDecodeError:
                        self.failed = True
                    self._state = "colon"
            elif ch.isspace():
                continue
            elif self._state == "start":
                self._state, self.failed = "key", ch != "{"
            elif self._state in ("key", "after") and ch == "}":
                self.done = True
            elif self._state == "after" and ch == ",":
                self._state = "key"
            elif self._state == "key" and ch == '"':
                self._state, self._key = "key_text", ""
            elif self._state == "colon" and ch == ":":
                self._state, self._value = "value", JsonValueReader()
            else:
                self.failed = True
        return i

    def _end_value(self) -> None:
        raw = self._value.text
        self._state = "after"
        if self._key == "name":
            try:
                name = json.loads(raw)
            except json.JSONDecodeError:
                name = None
            self.name, self.failed = (name, False) if isinstance(name, str) and name else (None, True)
        elif self._key in self.ARGUMENT_KEYS and not self._arguments_done:  # (a repeated key: the first counts)
            self.arguments, self._arguments_done = _unwrapped(raw), True

    def deltas(self, index: int) -> list[CallDelta]:
        """What is new of this call since the last time: nothing until its name is known (arguments written
        before the name wait for it)."""
        if self.name is None:
            return []
        out = CallDelta(index)
        if not self._sent_name:
            out.name, self._sent_name = self.name, True
        if not self.arguments.startswith('"') or self._arguments_done:  # (a JSON string waits to be unwrapped)
            out.arguments, self._sent_arguments = self.arguments[self._sent_arguments:], len(self.arguments)
        return [out] if out.name is not None or out.arguments else []


def _unwrapped(raw: str) -> str:
    """Arguments some models write as a JSON string holding the object's text: that text; others as they are."""
    if raw.startswith('"'):
        try:
            inner = json.loads(raw)
            if isinstance(inner, str) and isinstance(json.loads(inner), dict):
                return inner
        except (ValueError, RecursionError):
            pass
    return raw


class JsonCallList:
    """A JSON list of calls, `[{...}, {...}]`, read a piece at a time; its calls are numbered from `first`.
    `opened`: the bracket is not written (calls and commas only)."""

    def __init__(self, first: int = 0, opened: bool = False) -> None:
        self.first, self.count = first, 0  # calls named so far
        self.done = self.failed = False
        self._started = opened
        self._call: JsonCallReader | None = None

    def feed(self, text: str) -> tuple[int, list[CallDelta]]:
        """Reads up to the list's closing bracket: (characters used, the calls' new pieces)."""
        i, out = 0, []
        while i < len(text) and not (self.done or self.failed):
            if self._call is not None:
                i += self._call.feed(text[i:])
                out += self._call.deltas(self.first + self.count)
                if self._call.done or self._call.failed:
                    self.count += self._call.name is not None
                    self.failed, self._call = self._call.failed, None
                continue
            ch = text[i]
            i += 1
            if ch.isspace() or (self._started and ch == ","):
                continue
            if not self._started:
                self._started, self.failed = True, ch != "["
            elif ch == "]":
                self.done = True
            elif ch == "{":
                self._call, i = JsonCallReader(), i - 1  # (the reader reads the brace)
            else:
                self.failed = True
        return i, out


def _ends_escaped(text: str) -> bool:
    """Whether the character after `text` is escaped (an odd run of backslashes ends it)."""
    return (len(text) - len(text.rstrip("\\"))) % 2 == 1

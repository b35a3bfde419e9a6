"""A chat request's tool fields, checked (a 400 naming the field) and turned into what generating needs: the
tools for the chat template, and, for tool_choice "required" or a named function, the JSON schema that constrains
the reply to valid calls (a list of `{"name", "parameters"}` objects, or the named function's arguments), as
vLLM builds it."""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass

from jaxpaged.sampling_params import StructuredOutputsParams
from jaxpaged.structured.grammar import compile_grammar
from server.protocol import APIError, get_field

_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")  # (OpenAI's function names; vLLM takes the same)
AUTO_NEEDS_FLAGS = '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set'


@dataclass
class ToolRequest:
    tools: list[dict] | None  # as the client sent them ({"type": "function", "function": {...}}): the template's
    choice: str  # "none", "auto", "required" or "named"
    named: str | None = None  # the function tool_choice names
    parallel: bool = True  # parallel_tool_calls: more than one call in a reply

    def parameters(self, name: str) -> dict:
        fn = next(t["function"] for t in self.tools if t["function"]["name"] == name)
        return fn.get("parameters") or {"type": "object", "properties": {}}

    def constraint(self) -> StructuredOutputsParams | None:
        """The reply's constraint: the named function's arguments, or for "required" a list of one call or more
        (one only without parallel_tool_calls), each naming a tool and holding arguments valid for it."""
        if self.choice == "named":
            return StructuredOutputsParams(json=self.parameters(self.named))
        if self.choice != "required":
            return None
        defs: dict = {}
        calls = []
        for t in self.tools:
            params = dict(self.parameters(t["function"]["name"]))
            defs.update(_own_defs(params, defs))  # (refs like #/$defs/X point at the root: the defs move there)
            calls.append({"type": "object", "properties": {"name": {"type": "string", "enum": [t["function"]["name"]]},
                                                           "parameters": params},
                          "required": ["name", "parameters"], "additionalProperties": False})
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": calls}, **({"$defs": defs} if defs else {})}
        if not self.parallel:
            schema["maxItems"] = 1
        return StructuredOutputsParams(json=schema)


def _own_defs(params: dict, seen: dict) -> dict:
    """`params`' own `$defs` (taken out of it), checked against those of the tools before."""
    own = params.pop("$defs", None) or {}
    for name, d in own.items():
        if name in seen and seen[name] != d:
            raise APIError(f"two tools define $defs/{name} differently (tool_choice 'required' puts every tool's "
                           "definitions in one schema)", param="tools")
    return own


def tool_request_from(body: dict, *, auto_enabled: bool) -> ToolRequest:
    """The request's tools and tool_choice; `auto_enabled`: the server parses calls out of free replies
    (--enable-auto-tool-choice with a --tool-call-parser)."""
    tools = tools_from(body)
    parallel = get_field(body, "parallel_tool_calls", (bool,), True)
    choice = body.get("tool_choice")
    if choice is None:
        choice = "auto" if tools else "none"  # (OpenAI's and vLLM's default)
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise APIError(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                           param="tool_choice")
        if choice == "required" and not tools:
            raise APIError("When using `tool_choice`, `tools` must be set.", param="tool_choice")
        if choice == "auto" and tools and not auto_enabled:
            raise APIError(AUTO_NEEDS_FLAGS, param="tool_choice")
        request = ToolRequest(tools, choice, parallel=parallel)
        if choice == "required":
            request.constraint()  # (two tools' definitions that clash: a 400 now)
        return request
    fn = choice.get("function") if isinstance(choice, dict) and choice.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise APIError("a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tool_choice")
    if not tools or name not in {t["function"]["name"] for t in tools}:
        raise APIError(f"tool_choice names the function {name!r}, which is not in 'tools'", param="tool_choice")
    return ToolRequest(tools, "named", name, parallel)


def tools_from(body: dict) -> list[dict] | None:
    """The request's tools, checked (names unique and well formed, parameters a schema the grammar engine can
    use), or None."""
    tools = get_field(body, "tools", (list,), None)
    if not tools:
        return None
    seen = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise APIError(f"{where} must be an object with type 'function'", param="tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise APIError(f"{where} needs a 'function' object", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise APIError(f"{where}.function needs a 'name' of 1-64 letters, digits, '_', '-' or '.'",
                           param="tools")
        if name in seen:
            raise APIError(f"{where}: two tools are named {name!r}", param="tools")
        seen.add(name)
        if not isinstance(fn.get("description", ""), str):
            raise APIError(f"{where}.function.description must be a string", param="tools")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise APIError(f"{where}.function.parameters must be a JSON schema (an object)", param="tools")
            if why := _schema_problem(json.dumps(params)):
                raise APIError(f"{where}.function.parameters is not a usable JSON schema: {why}", param="tools")
    return [{**t, "type": "function"} for t in tools]


@functools.lru_cache(maxsize=512)
def _schema_problem(schema: str) -> str | None:
    """Why the grammar engine cannot use this schema (it constrains "required" and named calls), or None."""
    try:
        compile_grammar(StructuredOutputsParams(json=schema))
    except (ValueError, TypeError) as e:
        return str(e).split(": ", 1)[-1]
    return None


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages for a chat template: an assistant's tool_calls with their arguments as objects (templates write
    them with `tojson`; vLLM passes them so), the rest as they are."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            calls = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                     for c in m["tool_calls"]]
            m = {**m, "tool_calls": calls}
        out.append(m)
    return out

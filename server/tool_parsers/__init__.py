"""Tool parsers by vLLM's names (`--tool-call-parser`): each reads a choice's text as it is generated and says
what is content and what is a call (server/tool_parsers/base.py)."""

from __future__ import annotations

from server.tool_parsers.base import CallDelta, ParsedDelta, ToolParser
from server.tool_parsers.hermes import HermesToolParser
from server.tool_parsers.llama3_json import Llama3JsonToolParser
from server.tool_parsers.mistral import MistralToolParser
from server.tool_parsers.pythonic import PythonicToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": HermesToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "pythonic": PythonicToolParser,
}

__all__ = ["TOOL_PARSERS", "CallDelta", "ParsedDelta", "ToolParser"]

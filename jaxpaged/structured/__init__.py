"""Structured output: a grammar engine (llguidance) adapter that turns each constrained request into a packed
token bitmask per step, applied inside the jitted step."""

from jaxpaged.structured.grammar import compile_grammar
from jaxpaged.structured.manager import StructuredOutputManager

__all__ = ["StructuredOutputManager", "compile_grammar"]

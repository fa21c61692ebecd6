"""Structured outputs with xgrammar: grammars compiled off the engine thread, one matcher per
sequence, and a token bitmask applied to the constrained rows of each step."""
from pagedllm.structured_output.manager import GrammarState, StructuredOutputManager

__all__ = ["GrammarState", "StructuredOutputManager"]

"""Tool-call parsers, one per model family; `parser_for` picks the one the tokenizer's markers fit."""

from __future__ import annotations

from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers import glm, kimi
from backend.text.tool_parsers.base import ContentIds, ParsedCall, Piece, RawText, ToolParser
from backend.text.tool_parsers.glm import GlmToolParser
from backend.text.tool_parsers.kimi import KimiToolParser
from schemas.backend import Tool

PARSERS: dict[str, type[KimiToolParser] | type[GlmToolParser]] = {
    "kimi": KimiToolParser,
    "glm": GlmToolParser,
}

# each family's call markers (single special tokens of its tokenizer)
MARKERS: dict[str, tuple[str, ...]] = {"kimi": kimi.MARKERS, "glm": glm.MARKERS}


def parser_for(family: str, tokenizer: Tokenizer, tools: list[Tool]) -> ToolParser | None:
    """The family's parser for one request, or None when the tokenizer lacks the family's markers."""
    cls = PARSERS[family]
    return cls(tokenizer, tools) if cls.supports(tokenizer) else None


__all__ = ["MARKERS", "ContentIds", "ParsedCall", "Piece", "RawText", "ToolParser", "parser_for"]

"""Test helper: tokenizer folders for both families, written once per test session."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.text.tokenizer import Tokenizer, load_tokenizer
from backend.text.tokenizer_files import write_tokenizer_files

LAYOUTS = {
    "kimi-tiktoken": ("kimi", "tiktoken"),
    "kimi-json": ("kimi", "tokenizer.json"),
    "glm": ("glm", "tokenizer.json"),
}


def tokenizer_dir(factory: pytest.TempPathFactory, layout: str) -> Path:
    family, fmt = LAYOUTS[layout]
    path = factory.getbasetemp() / f"tokenizer-{layout}"
    if not (path / "tokenizer_config.json").exists():
        write_tokenizer_files(family, path, fmt=fmt)  # type: ignore[arg-type]
    return path


def load(factory: pytest.TempPathFactory, layout: str) -> Tokenizer:
    return load_tokenizer(tokenizer_dir(factory, layout))


def ordinary_ids(tok: Tokenizer, text: str) -> list[int]:
    """`text` as ordinary tokens only, even where it spells a special token."""
    return tok.encode(text, allow_special=False)

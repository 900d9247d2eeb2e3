"""`kumo eval` task files: JSONL, one item per line, in lm-evaluation-harness spirit.

The kind is told by the keys of the first line:
- multiple choice `{"question": str, "choices": [str, ...], "answer": int}` — each choice is scored
  by the summed log-likelihood of its tokens after the question (as ARC and MMLU are); the best wins.
  `kumo eval` also reports the pick by log-likelihood per byte of the choice (`NAME:norm`).
- generation `{"prompt": str, "answer": str, "answer_regex"?: str}` — greedy decoding; the answer is
  the regex's first group (else its whole match, else the stripped text), compared exactly (GSM8K).
- tool call `{"messages": [Message], "tools": [Tool], "expected": {"name": str, "arguments": {...}}}`
  (`schemas.backend` Message / Tool) — the checkpoint's chat template renders the conversation with
  the tools, greedy decoding runs to a stop token, the family's tool-call parser reads the output,
  and the first call must have the expected name and arguments (compared as JSON values).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Literal

import msgspec

from backend.tokenizer import Tokenizer
from backend.tool_parsers import ParsedCall, parser_for
from schemas.backend import Message, Tool

TaskKind = Literal["multiple_choice", "generation", "tool_call"]


class McItem(msgspec.Struct):
    question: str
    choices: list[str]
    answer: int


class GenItem(msgspec.Struct):
    prompt: str
    answer: str
    answer_regex: str | None = None


class ExpectedCall(msgspec.Struct):
    name: str
    arguments: dict[str, Any] = {}


class ToolItem(msgspec.Struct):
    messages: list[Message]
    tools: list[Tool]
    expected: ExpectedCall


Item = McItem | GenItem | ToolItem
_KINDS: tuple[tuple[str, TaskKind, type], ...] = (
    ("choices", "multiple_choice", McItem),
    ("expected", "tool_call", ToolItem),
    ("prompt", "generation", GenItem),
)


def load_items(path: Path) -> tuple[TaskKind, list[Any]]:
    """The kind and items of a task file; ValueError naming the file and line of a bad item."""
    rows = [(n, json.loads(line)) for n, line in enumerate(path.read_text().splitlines(), 1) if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no items")
    for key, kind, cls in _KINDS:
        if key in rows[0][1]:
            items = []
            for n, row in rows:
                try:
                    items.append(msgspec.convert(row, cls))
                    _check(items[-1])
                except (msgspec.ValidationError, ValueError) as exc:
                    raise ValueError(f"{path} line {n}: {exc}") from exc
            return kind, items
    raise ValueError(f"{path}: the first item has none of the keys choices / expected / prompt")


def _check(item: Item) -> None:
    """What the schema cannot say: an answer index among the choices, a regex that compiles."""
    if isinstance(item, McItem):
        if not item.choices:
            raise ValueError("no choices")
        if not 0 <= item.answer < len(item.choices):
            raise ValueError(f"answer {item.answer} is not an index of its {len(item.choices)} choices")
    if isinstance(item, GenItem) and item.answer_regex is not None:
        try:
            re.compile(item.answer_regex)
        except re.error as exc:
            raise ValueError(f"answer_regex {item.answer_regex!r}: {exc}") from exc


def extract_answer(text: str, item: GenItem) -> str:
    if item.answer_regex and (m := re.search(item.answer_regex, text)):
        return ((m.group(1) or "") if m.groups() else m.group(0)).strip()
    return text.strip()


def tool_call_matches(family: str, tokenizer: Tokenizer, item: ToolItem, output_ids: list[int]) -> bool:
    """Whether the model's output holds, first, the expected call."""
    parser = parser_for(family, tokenizer, item.tools)
    if parser is None:
        raise ValueError(f"the tokenizer lacks the {family} tool-call markers")
    pieces = parser.feed(output_ids) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    if not calls:
        return False
    try:
        arguments = json.loads(calls[0].arguments)
    except json.JSONDecodeError:
        return False
    return calls[0].name == item.expected.name and arguments == item.expected.arguments

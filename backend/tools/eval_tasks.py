"""`kumo eval` task files: JSONL, one item per line, in lm-evaluation-harness spirit.

The kind is told by the keys of the first line:
- multiple choice `{"prompt" | "question": str, "choices": [str, ...], "answer": int,
  "messages"?: [Message], "choice_format"?: str}` — each choice is scored by the summed
  log-likelihood of its tokens, the best wins (ARC, MMLU); `kumo eval` also reports the pick by
  log-likelihood per byte of the choice (`NAME:norm`). Raw: the tokens of " CHOICE" after the
  question text. Chat: the prompt is `messages` (else one user turn with the question) rendered as
  serving renders it, and a choice is the assistant turn `choice_format` makes of it (`{letter}`,
  `{choice}`; `"{letter}. {choice}"` for a lettered listing), scored on the ids the model would emit
  for that turn (`backend.text.assistant_turn`, the rule the training recipe trains on).
- generation `{"prompt"?: str, "messages"?: [Message], "answer": str, "answer_regex"?: str,
  "accept_regex"?: str}` — greedy decoding; the answer is the regex's first group (else its whole
  match, else the stripped text), compared exactly (GSM8K); with `accept_regex` (open replies such as
  greetings) the reply is right when the regex matches it and it carries no chat-format markup. Chat: the regex reads the answer after the reasoning; image parts
  of `messages` go through serving's image path.
- tool call `{"messages": [Message], "tools": [Tool], "expected": {"name": str, "arguments": {...}}}`
  — the checkpoint's chat template renders the conversation with the tools, greedy decoding runs to
  a stop token, the family's tool-call parser reads the output (as serving does), and the first call
  must have the expected name and arguments (compared as JSON values).

`Message` / `Tool` are `schemas.backend`'s (an image part carries its bytes, base64 in JSON). A
conversation may be a whole transcript: its turns from the first assistant one on are not the prompt.
"""

from __future__ import annotations

import json
import re
import string
from pathlib import Path
from typing import Any, Literal

import msgspec

from schemas.backend import Message, Tool, ToolCallDelta

TaskKind = Literal["multiple_choice", "generation", "tool_call"]
LETTERS = string.ascii_uppercase


class McItem(msgspec.Struct):
    choices: list[str]
    answer: int
    prompt: str | None = None
    question: str | None = None  # lm-evaluation-harness's name for `prompt`
    messages: list[Message] | None = None
    choice_format: str = "{choice}"

    @property
    def text(self) -> str:
        """The question, as the raw mode continues it."""
        return self.question if self.question is not None else self.prompt or ""

    def turn(self, index: int) -> str:
        """The assistant turn that gives choice `index` (chat mode)."""
        return self.choice_format.format(letter=LETTERS[index], choice=self.choices[index])


class GenItem(msgspec.Struct):
    answer: str
    prompt: str | None = None
    messages: list[Message] | None = None
    answer_regex: str | None = None
    accept_regex: str | None = None  # instead of `answer`: right when it matches the reply, markup-free


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
            items: list[Any] = []
            for n, row in rows:
                try:
                    items.append(msgspec.convert(row, cls))
                    _check(items[-1])
                except (msgspec.ValidationError, ValueError) as exc:
                    raise ValueError(f"{path} line {n}: {exc}") from exc
            return kind, items
    raise ValueError(f"{path}: the first item has none of the keys choices / expected / prompt")


def _check(item: Item) -> None:
    """What the schema cannot say: an answer index among the choices, a format that formats, a
    regex that compiles, some prompt."""
    if isinstance(item, McItem):
        if not item.choices:
            raise ValueError("no choices")
        if not 0 <= item.answer < len(item.choices):
            raise ValueError(f"answer {item.answer} is not an index of its {len(item.choices)} choices")
        if item.prompt is None and item.question is None and item.messages is None:
            raise ValueError("no prompt, question or messages")
        if "{letter}" in item.choice_format and len(item.choices) > len(LETTERS):
            raise ValueError(f"{len(item.choices)} choices are more than there are letters")
        try:
            item.turn(0)
        except (KeyError, IndexError, ValueError) as exc:
            raise ValueError(f"choice_format {item.choice_format!r}: only {{letter}} and {{choice}}") from exc
    if isinstance(item, GenItem):
        if item.prompt is None and item.messages is None:
            raise ValueError("no prompt or messages")
        for key, regex in (("answer_regex", item.answer_regex), ("accept_regex", item.accept_regex)):
            if regex is not None:
                try:
                    re.compile(regex)
                except re.error as exc:
                    raise ValueError(f"{key} {regex!r}: {exc}") from exc


def prompt_turns(messages: list[Message]) -> list[Message]:
    """The turns before the first assistant one: the prompt of a conversation or transcript."""
    first = next((i for i, m in enumerate(messages) if m.role == "assistant"), len(messages))
    return messages[:first]


def extract_answer(text: str, item: GenItem) -> str:
    if item.answer_regex and (m := re.search(item.answer_regex, text)):
        return ((m.group(1) or "") if m.groups() else m.group(0)).strip()
    return text.strip()


MARKUP = re.compile(r"<\|[^|>]*\|>|</?think>|</?tool_call>|<arg_(key|value)>")


def generation_correct(content: str, item: GenItem) -> bool:
    """Exact match of the extracted answer; for an `accept_regex` item (an open reply such as a greeting):
    a reply that matches it and carries no chat-format markup."""
    if item.accept_regex is not None:
        return (
            bool(content.strip())
            and not MARKUP.search(content)
            and bool(re.search(item.accept_regex, content))
        )
    return extract_answer(content, item) == item.answer.strip()


def call_matches(calls: list[ToolCallDelta], expected: ExpectedCall) -> bool:
    """Whether the first of the calls serving parsed from the output is the expected one."""
    if not calls:
        return False
    try:
        arguments = json.loads(calls[0].arguments)
    except json.JSONDecodeError:
        return False
    return calls[0].name == expected.name and arguments == expected.arguments

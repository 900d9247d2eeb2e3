"""What every family's tool-call parser shares: its output pieces and the checks a call must pass.

Parsers work on token ids, because both families spell their call markers as single special tokens:
a marker never arrives half-way through a chunk, and the same characters written as ordinary tokens
inside an argument are just text. A call is reported once it is complete and checked (known name,
arguments a JSON object), so a stream never shows half a name or a call that later turns out broken;
a malformed call comes back as the text the model wrote (its markers left out), never as an
exception, and a call the output ends inside is dropped.

Feeding all ids at once or one at a time gives the same pieces (streaming = non-streaming).
"""

from __future__ import annotations

import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from backend.text.tokenizer import Tokenizer
from schemas.backend import Tool


@dataclass(frozen=True, slots=True)
class ParsedCall:
    index: int
    id: str
    name: str
    arguments: str  # JSON text of an object


@dataclass(frozen=True, slots=True)
class ContentIds:
    """Answer tokens, to be detokenized by the caller's incremental detokenizer."""

    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class RawText:
    """A malformed call, returned verbatim (markers spelled out) as answer text."""

    text: str
    # the ids the text was decoded from (markers left out), in order: whose logprobs go with it
    source_ids: list[int] = field(default_factory=list, compare=False)


Piece = ParsedCall | ContentIds | RawText


@dataclass(frozen=True, slots=True)
class Fed:
    """What one id `ToolParser.feed` took did (`ToolParser.trace`): passed to the answer text at once
    (`is_content`), else held; the calls and texts it completed (`pieces`: a parsed call takes the
    ids held before it, a malformed call's text those of its `source_ids`); and whether the parser
    holds nothing after it (`is_idle`: what it held and did not return as text is gone, layout
    between calls and the markers)."""

    is_content: bool
    pieces: list[ParsedCall | RawText]
    is_idle: bool


def marker_ids(tokenizer: Tokenizer, spellings: tuple[str, ...]) -> tuple[int, ...] | None:
    """The single-token ids of `spellings`, or None if the tokenizer lacks any of them."""
    ids = [tokenizer.token_to_id(s) for s in spellings]
    return None if any(i is None for i in ids) else tuple(i for i in ids if i is not None)


def is_json_object(text: str) -> bool:
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


class ToolParser(ABC):
    """Incremental parser for one request's output (content channel only)."""

    def __init__(self, tokenizer: Tokenizer, tools: list[Tool]) -> None:
        self._tokenizer = tokenizer
        self._tools: dict[str, dict[str, Any]] = {t.name: t.parameters for t in tools}
        self._num_calls = 0
        self._pieces: list[Piece] = []
        self._special_ids = tokenizer.special_ids  # markers out of place are not text either
        self._num_content = 0  # ids passed to answer text so far
        self.trace: list[Fed] = []  # per id of the last `feed`

    @property
    def num_calls(self) -> int:
        return self._num_calls

    def feed(self, token_ids: list[int]) -> list[Piece]:
        """Pieces completed by these ids, in order; what each id did in `trace`."""
        trace = self.trace = []
        for token_id in token_ids:
            num_pieces, num_content = len(self._pieces), self._num_content
            self._step(token_id)
            done = [p for p in self._pieces[num_pieces:] if not isinstance(p, ContentIds)]
            trace.append(Fed(self._num_content > num_content, done, self.is_idle))
        return self._take()

    @property
    @abstractmethod
    def is_idle(self) -> bool:
        """No call (or section of calls) is open: nothing is held."""

    def finish(self) -> list[Piece]:
        """At the end of the output: a call cut short (by `max_tokens`) is dropped, never shown as
        half a call; what else was held comes back as text."""
        self._close()
        return self._take()

    def _take(self) -> list[Piece]:
        pieces, self._pieces = self._pieces, []
        return pieces

    def _content(self, token_id: int) -> None:
        if token_id in self._special_ids:  # a stray closing marker outside a call
            return
        self._num_content += 1
        last = self._pieces[-1] if self._pieces else None
        if isinstance(last, ContentIds):
            last.token_ids.append(token_id)
        else:
            self._pieces.append(ContentIds([token_id]))

    def _raw(self, token_ids: list[int]) -> None:
        """A malformed call as plain text: what the model wrote, its markers (special tokens) left out."""
        source = [t for t in token_ids if t not in self._special_ids]
        text = self._tokenizer.decode(source)
        if text:
            self._pieces.append(RawText(text, source))

    def _checked(self, call_id: str | None, name: str, arguments: str) -> ParsedCall | None:
        """The call with the next index if it is well formed (a known tool, arguments a JSON object)."""
        if name not in self._tools or not is_json_object(arguments):
            return None
        index = self._num_calls
        self._num_calls += 1
        return ParsedCall(index, call_id or self._new_id(name, index), name, arguments)

    def _new_id(self, name: str, index: int) -> str:
        raise NotImplementedError(f"{type(self).__name__} needs call ids from the model")

    @abstractmethod
    def _step(self, token_id: int) -> None: ...

    @abstractmethod
    def _close(self) -> None: ...

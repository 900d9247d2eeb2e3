"""Kimi K2 tool calls (`engine-anchors.md` §1i):

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> …
    <|tool_calls_section_end|>

The `functions.NAME:IDX` id is kept verbatim as the call id, so when the call comes back in the
history (`tool_call_id` of the tool result, `id` of the assistant's call) the template renders
exactly what the model wrote.

A section becomes a tool-call section with its first well-formed call; until then it is held, and a
section that ends (or an output that ends) without one comes back whole as text, markers left out;
an output that ends inside a call drops that call. Inside a real
section, layout between calls is dropped and a malformed call comes back as its text. A call written
without a section (as vLLM accepts) is its own section.
"""

from __future__ import annotations

import re
from enum import Enum, auto

from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers.base import ToolParser, marker_ids
from schemas.backend import Tool

MARKERS = (
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
)
CALL_ID = re.compile(r"^(?:functions\.)?(?P<name>[^\s:]+):(?P<index>\d+)$")


class _State(Enum):
    TEXT = auto()
    SECTION = auto()
    CALL_ID = auto()
    ARGUMENTS = auto()


class KimiToolParser(ToolParser):
    def __init__(self, tokenizer: Tokenizer, tools: list[Tool]) -> None:
        super().__init__(tokenizer, tools)
        ids = marker_ids(tokenizer, MARKERS)
        if ids is None:
            raise ValueError("tokenizer lacks Kimi tool-call markers")
        self._section_begin, self._section_end, self._call_begin, self._arg_begin, self._call_end = ids
        self._state = _State.TEXT
        self._section_ids: list[int] = []  # the open section as written
        self._held: list[list[int]] = []  # malformed calls of a section that has no good call yet
        self._is_committed = False  # the open section has a good call: it is a real tool-call section
        self._is_sectionless = False
        self._call_ids: list[int] = []  # the open call as written
        self._id_ids: list[int] = []
        self._arg_ids: list[int] = []

    @classmethod
    def supports(cls, tokenizer: Tokenizer) -> bool:
        return marker_ids(tokenizer, MARKERS) is not None

    @property
    def is_idle(self) -> bool:
        return self._state is _State.TEXT

    def _step(self, t: int) -> None:
        if self._state is _State.TEXT:
            if t == self._section_begin:
                self._open_section([t], is_sectionless=False)
            elif t == self._call_begin:
                self._open_section([t], is_sectionless=True)
                self._open_call(t)
            else:
                self._content(t)
            return
        self._section_ids.append(t)
        if self._state is _State.SECTION:
            self._in_section(t)
        elif self._state is _State.CALL_ID:
            if t == self._arg_begin:
                self._call_ids.append(t)
                self._state = _State.ARGUMENTS
            else:
                self._in_call(t, self._id_ids)
        else:
            self._in_call(t, self._arg_ids)

    def _in_section(self, t: int) -> None:
        if t == self._call_begin:
            self._open_call(t)
        elif t == self._section_end:
            self._close_section()
        # anything else between calls is layout: dropped if the section turns out real

    def _in_call(self, t: int, part: list[int]) -> None:
        if t == self._call_end and self._state is _State.ARGUMENTS:
            self._call_ids.append(t)
            self._close_call()
        elif t in (self._call_begin, self._section_end):  # the open call is cut short; t starts what is next
            self._section_ids.pop()
            self._broken_call()
            self._step(t)
        elif t in (self._section_begin, self._arg_begin, self._call_end):
            self._call_ids.append(t)
            self._broken_call()
        else:
            self._call_ids.append(t)
            part.append(t)

    def _open_section(self, ids: list[int], *, is_sectionless: bool) -> None:
        self._state = _State.SECTION
        self._section_ids, self._held, self._is_committed = ids, [], False
        self._is_sectionless = is_sectionless

    def _open_call(self, t: int) -> None:
        self._state = _State.CALL_ID
        self._call_ids, self._id_ids, self._arg_ids = [t], [], []

    def _close_call(self) -> None:
        call_id = self._tokenizer.decode(self._id_ids).strip()
        match = CALL_ID.match(call_id)
        name = match.group("name").split(".")[-1] if match else ""
        call = self._checked(call_id, name, self._tokenizer.decode(self._arg_ids).strip())
        if call is None:
            self._broken_call()
            return
        if not self._is_committed:
            self._is_committed = True
            for ids in self._held:
                self._raw(ids)
            self._held = []
        self._pieces.append(call)
        self._after_call()

    def _broken_call(self) -> None:
        if self._is_committed:
            self._raw(self._call_ids)
        else:
            self._held.append(self._call_ids)
        self._call_ids = []
        self._after_call()

    def _after_call(self) -> None:
        self._state = _State.SECTION
        if self._is_sectionless:
            self._close_section()

    def _close_section(self) -> None:
        if not self._is_committed:
            self._raw(self._section_ids)  # no good call: everything the section held is text
        self._section_ids, self._held, self._is_committed = [], [], False
        self._state = _State.TEXT

    def _close(self) -> None:
        if self._state in (_State.CALL_ID, _State.ARGUMENTS):  # cut short: dropped, section and all
            if not self._is_committed:
                self._section_ids, self._held = [], []
            self._call_ids = []
            self._after_call()
        if self._state is _State.SECTION:
            self._close_section()

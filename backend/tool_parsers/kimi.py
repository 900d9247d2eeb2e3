"""Kimi K2 tool calls (`engine-anchors.md` §1i):

    <|tool_calls_section_begin|>
      <|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|> …
    <|tool_calls_section_end|>

The `functions.NAME:IDX` id is kept verbatim as the call id, so when the call comes back in the
history (`tool_call_id` of the tool result, `id` of the assistant's call) the template renders
exactly what the model wrote.
"""

from __future__ import annotations

import re
from enum import Enum, auto

from backend.tokenizer import Tokenizer
from backend.tool_parsers.base import ToolParser, marker_ids
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
        self._raw_ids: list[int] = []  # the open call, as written
        self._id_ids: list[int] = []
        self._arg_ids: list[int] = []

    @classmethod
    def supports(cls, tokenizer: Tokenizer) -> bool:
        return marker_ids(tokenizer, MARKERS) is not None

    def _step(self, t: int) -> None:
        state = self._state
        if state is _State.TEXT:
            if t == self._section_begin:
                self._state = _State.SECTION
            elif t == self._call_begin:  # a call without its section: accepted, as vLLM does
                self._open_call(t)
            else:
                self._content(t)
        elif state is _State.SECTION:
            if t == self._call_begin:
                self._open_call(t)
            elif t == self._section_end:
                self._state = _State.TEXT
            # anything else between calls (newlines) is layout
        elif state is _State.CALL_ID:
            self._raw_ids.append(t)
            if t == self._arg_begin:
                self._state = _State.ARGUMENTS
            elif t in (self._call_end, self._call_begin, self._section_begin, self._section_end):
                self._malformed()
            else:
                self._id_ids.append(t)
        else:
            self._raw_ids.append(t)
            if t == self._call_end:
                self._close_call()
            elif t in (self._arg_begin, self._call_begin, self._section_begin, self._section_end):
                self._malformed()
            else:
                self._arg_ids.append(t)

    def _open_call(self, t: int) -> None:
        self._state = _State.CALL_ID
        self._raw_ids, self._id_ids, self._arg_ids = [t], [], []

    def _malformed(self) -> None:
        self._raw(self._raw_ids)
        self._raw_ids = []
        self._state = _State.TEXT

    def _close_call(self) -> None:
        call_id = self._tokenizer.decode(self._id_ids).strip()
        match = CALL_ID.match(call_id)
        name = match.group("name").split(".")[-1] if match else ""
        self._call(call_id, name, self._tokenizer.decode(self._arg_ids).strip(), self._raw_ids)
        self._raw_ids = []
        self._state = _State.SECTION

    def _close(self) -> None:
        if self._state in (_State.CALL_ID, _State.ARGUMENTS):
            self._malformed()
        self._state = _State.TEXT

"""GLM-4.5 / GLM-5 tool calls (`engine-anchors.md` §1i):

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    …
    </tool_call>

The template writes string values raw and everything else as JSON, so values are typed back by the
tool's JSON schema: a string-typed argument keeps its text exactly; any other is parsed as JSON,
and kept as text if it is not JSON (a model may write an unquoted word where a number was asked).
GLM writes no call ids; each call gets a fresh `call_…` id.
"""

from __future__ import annotations

import json
import uuid
from enum import Enum, auto
from typing import Any

from backend.errors import InvalidRequest
from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers.base import ToolParser, marker_ids
from schemas.backend import Tool

MARKERS = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>")


class _State(Enum):
    TEXT = auto()
    NAME = auto()
    KEY = auto()
    AFTER_KEY = auto()
    VALUE = auto()
    BETWEEN = auto()


def is_string_typed(schema: dict[str, Any]) -> bool:
    """A string, or a string or null: GLM writes the value raw (unquoted)."""
    kind = schema.get("type")
    return kind == "string" or (
        isinstance(kind, list) and all(k in ("string", "null") for k in kind) and "string" in kind
    )


def resolved(schema: Any, root: dict[str, Any], where: str | None = None) -> Any:
    """An argument's schema as GLM types it, alone: its local `$ref` followed into the tool's
    parameters `root` (pydantic's nested models: `{"$ref": "#/$defs/City"}`, a string; the probe of
    2026-12-07: GLM's grammar refused it, "Pointer '/$defs/City' does not exist"), with the
    parameters' definitions carried beside it where a ref remains further in. A ref loop stays a
    ref. A ref naming nothing, or naming no schema, is the caller's 400 (`where`: the argument, for
    the message); where `where` is None (the parser: the grammar has refused it already) the
    schema is left as written (a ref to `true`: any value, `{}`)."""
    seen: set[str] = set()
    while isinstance(schema, dict) and isinstance(schema.get("$ref"), str) and schema["$ref"].startswith("#"):
        ref = schema["$ref"]
        if ref in seen:
            break
        seen.add(ref)
        target = _pointer(root, ref)
        if target is True:
            target = {}
        if not isinstance(target, dict):
            if where is None:
                return schema
            if target is None:
                raise InvalidRequest(f"{where}: $ref {ref!r}: Pointer {ref[1:]!r} does not exist")
            if target is False:
                raise InvalidRequest(
                    f"{where}: $ref {ref!r} names `false`: an argument that can never be given"
                )
            raise InvalidRequest(f"{where}: $ref {ref!r} names no schema")
        schema = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
    if not isinstance(schema, dict) or '"$ref"' not in json.dumps(schema):
        return schema
    defs = {
        k: {**root[k], **schema.get(k, {})} for k in ("$defs", "definitions") if isinstance(root.get(k), dict)
    }
    return {**schema, **defs}


def _pointer(root: dict[str, Any], ref: str) -> Any:
    """The part of `root` a local `$ref` (`#`, `#/$defs/City`) names, or None."""
    node: Any = root
    for part in ref[1:].split("/")[1:]:
        key = part.replace("~1", "/").replace("~0", "~")
        if isinstance(node, dict) and key in node:
            node = node[key]
        elif isinstance(node, list) and key.isdigit() and int(key) < len(node):
            node = node[int(key)]
        else:
            return None
    return node


def is_nullable(schema: dict[str, Any]) -> bool:
    kind = schema.get("type")
    return isinstance(kind, list) and "null" in kind


def typed_value(text: str, schema: Any) -> Any:
    """A value as the template would have written it back: raw for strings (`null`, as the template
    writes None, is null where the schema allows it), else JSON if it parses. A schema that is not an
    object (`true`, or a malformed one) types nothing."""
    if isinstance(schema, dict) and is_string_typed(schema):
        return None if text == "null" and is_nullable(schema) else text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class GlmToolParser(ToolParser):
    def __init__(self, tokenizer: Tokenizer, tools: list[Tool]) -> None:
        super().__init__(tokenizer, tools)
        ids = marker_ids(tokenizer, MARKERS)
        if ids is None:
            raise ValueError("tokenizer lacks GLM tool-call markers")
        (
            self._call_begin,
            self._call_end,
            self._key_begin,
            self._key_end,
            self._value_begin,
            self._value_end,
        ) = ids
        self._markers = frozenset(ids)
        self._state = _State.TEXT
        self._raw_ids: list[int] = []
        self._name_ids: list[int] = []
        self._pairs: list[tuple[list[int], list[int]]] = []
        self._gap_ids: list[int] = []  # what lies between markers that should be layout only

    @classmethod
    def supports(cls, tokenizer: Tokenizer) -> bool:
        return marker_ids(tokenizer, MARKERS) is not None

    @property
    def is_idle(self) -> bool:
        return self._state is _State.TEXT

    def _new_id(self, name: str, index: int) -> str:
        return f"call_{uuid.uuid4().hex[:24]}"

    def _step(self, t: int) -> None:
        state = self._state
        if state is _State.TEXT:
            if t == self._call_begin:
                self._state = _State.NAME
                self._raw_ids, self._name_ids, self._pairs, self._gap_ids = [t], [], [], []
            else:
                self._content(t)
            return
        self._raw_ids.append(t)
        transitions: dict[_State, dict[int, _State | None]] = {
            _State.NAME: {self._key_begin: _State.KEY, self._call_end: None},
            _State.KEY: {self._key_end: _State.AFTER_KEY},
            _State.AFTER_KEY: {self._value_begin: _State.VALUE},
            _State.VALUE: {self._value_end: _State.BETWEEN},
            _State.BETWEEN: {self._key_begin: _State.KEY, self._call_end: None},
        }
        expected = transitions[state]
        if t in expected:
            if not self._gap_is_layout():
                self._malformed()
                return
            nxt = expected[t]
            if nxt is None:
                self._close_call()
                return
            if nxt is _State.KEY:
                self._pairs.append(([], []))
            self._state = nxt
        elif t == self._call_begin:  # a new call before this one closed: this one is text, that one starts
            self._raw_ids.pop()
            self._malformed()
            self._step(t)
        elif t in self._markers:
            self._malformed()
        elif state is _State.NAME:
            self._name_ids.append(t)
        elif state is _State.KEY:
            self._pairs[-1][0].append(t)
        elif state is _State.VALUE:
            self._pairs[-1][1].append(t)
        else:
            self._gap_ids.append(t)

    def _gap_is_layout(self) -> bool:
        gap, self._gap_ids = self._gap_ids, []
        return not gap or not self._tokenizer.decode(gap).strip()

    def _malformed(self) -> None:
        self._raw(self._raw_ids)
        self._raw_ids = []
        self._state = _State.TEXT

    def _close_call(self) -> None:
        name = self._tokenizer.decode(self._name_ids).strip()
        parameters = self._tools.get(name, {})
        properties = parameters.get("properties", {})
        if not isinstance(properties, dict):  # the caller's malformed schema: values typed as JSON
            properties = {}
        arguments: dict[str, Any] = {}
        for key_ids, value_ids in self._pairs:
            key = self._tokenizer.decode(key_ids).strip()
            schema = resolved(properties.get(key), parameters)
            arguments[key] = typed_value(self._tokenizer.decode(value_ids), schema)
        call = self._checked(None, name, json.dumps(arguments, ensure_ascii=False))
        if call is None:
            self._raw(self._raw_ids)
        else:
            self._pieces.append(call)
        self._raw_ids = []
        self._state = _State.TEXT

    def _close(self) -> None:
        if self._state is not _State.TEXT:  # the output ends inside a call: dropped, not half a call
            self._raw_ids = []
            self._state = _State.TEXT

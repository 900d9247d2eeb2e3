"""Constrained decoding with llguidance: JSON mode, JSON schemas, and forced tool calls.

The request's format becomes an llguidance grammar; a `GrammarConstraint` holds the matcher for one
request and answers the engine's `TokenConstraint` calls, so the batched sampler masks constrained
and free requests in the same batch. A schema llguidance cannot compile is the caller's mistake: a
400 `InvalidRequest` carrying llguidance's reason (never our grammar text or its token ids), raised
before the request reaches the engine.

Forced tool calls (`tool_choice` required / named) constrain the output to the family's own call
syntax with the arguments constrained by the tool's schema:
- Kimi: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>`
  JSON `<|tool_call_end|>`… `<|tool_calls_section_end|>`, `IDX` continuing the conversation's count;
- GLM: `<tool_call>NAME\n<arg_key>K</arg_key>\n<arg_value>V</arg_value>\n…</tool_call>` with the
  arguments in schema order (required ones always), strings raw and other values as JSON.
A named tool is called once; `required` allows up to `MAX_PARALLEL_CALLS` calls when parallel calls are on.

With tools offered and `tool_choice` auto (or absent) the same grammar is lazy (`LazyToolConstraint`,
as llama.cpp's lazy grammars and llguidance's tool-call use): the model writes freely, and reasoning
stays on, until it opens a call with the family's first marker; from that token on the grammar holds,
so a call names an offered tool and its arguments follow that tool's schema. The other markers are
kept out of the free text. Where no tool may be called (none offered, or `tool_choice: none`) the
engine's token guard keeps all of them out (`unoffered_markers`).
"""

from __future__ import annotations

import json
import re
from typing import Any

import llguidance
import numpy as np
import torch

from backend.errors import InvalidRequest
from backend.text.tool_parsers import MARKERS as TOOL_MARKERS
from backend.text.tool_parsers.glm import is_nullable, is_string_typed, resolved
from schemas.backend import GenerateRequest, Tool

JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False}
# Tool arguments as the chat templates render them (json.dumps / jinja's tojson: ", " and ": "): the
# form the models saw in training. Compact arguments (the 2026-12-04 held-out run through the API)
# left nano Kimi's calls scoring 0 of 60 where in-process decoding scored 9: blocked from its space,
# it wrote junk keys. Still fixed separators, never free whitespace (no padding a value forever).
TOOL_JSON_OPTIONS: dict[str, Any] = JSON_OPTIONS | {"item_separator": ", ", "key_separator": ": "}
MAX_PARALLEL_CALLS = 4  # `tool_choice: required` with parallel calls allowed: at most this many in one turn


class GrammarConstraint:
    """One request's llguidance matcher behind the engine's `TokenConstraint` protocol."""

    def __init__(self, matcher: llguidance.LLMatcher) -> None:
        self._matcher = matcher

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        words = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        bits = np.unpackbits(words, bitorder="little")[:vocab_size].astype(bool)  # [vocab]
        if bits.shape[0] < vocab_size:
            bits = np.concatenate([bits, np.zeros(vocab_size - bits.shape[0], dtype=bool)])
        return torch.from_numpy(bits)

    def accept(self, token_id: int) -> None:
        self._matcher.consume_token(token_id)

    def is_finished(self) -> bool:
        return bool(self._matcher.is_stopped() or self._matcher.is_error())

    def rollback(self, num_tokens: int) -> None:
        self._matcher.rollback(num_tokens)

    @property
    def error(self) -> str | None:
        """Why the grammar stopped the output unfinished, in the caller's words (llguidance's own
        message quotes the grammar), or None."""
        if not self._matcher.is_error():
            return None
        # a schema that requires itself fills the parser until it hits its item limit, as any
        # grammar too complex for it does: the two look alike ("Too many items (limit 50000; …)")
        return (
            "The response format or tool parameters could not be followed to the end: the schema "
            "admits no complete value (it requires itself, directly or through $ref) or is too "
            "complex for the grammar engine."
        )


class LazyToolConstraint:
    """Free until `trigger_id`, then the tool-call grammar's matcher (fed the trigger first). Before
    the trigger `banned_ids` are masked out."""

    def __init__(self, grammar: GrammarConstraint, trigger_id: int, banned_ids: list[int]) -> None:
        self._grammar = grammar
        self._trigger_id = trigger_id
        self._banned_ids = banned_ids
        self._free_mask: torch.Tensor | None = None
        self._num_constrained = 0  # tokens the matcher consumed, the trigger first

    @property
    def is_triggered(self) -> bool:
        return self._num_constrained > 0

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        if self.is_triggered:
            return self._grammar.allowed_tokens(vocab_size)
        if self._free_mask is None or self._free_mask.shape[0] != vocab_size:
            mask = torch.ones(vocab_size, dtype=torch.bool)  # [vocab]
            mask[[i for i in self._banned_ids if i < vocab_size]] = False
            self._free_mask = mask
        return self._free_mask

    def accept(self, token_id: int) -> None:
        if self.is_triggered or token_id == self._trigger_id:
            self._grammar.accept(token_id)
            self._num_constrained += 1

    def is_finished(self) -> bool:
        return self.is_triggered and self._grammar.is_finished()

    @property
    def error(self) -> str | None:
        return self._grammar.error if self.is_triggered else None

    def rollback(self, num_tokens: int) -> None:
        undo = min(num_tokens, self._num_constrained)  # free tokens before the trigger hold no state
        if undo:
            self._grammar.rollback(undo)
            self._num_constrained -= undo


def _json_grammar(schema: dict[str, Any]) -> str:
    try:
        return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
    except ValueError as exc:
        raise InvalidRequest(f"response_format.json_schema: {exc}") from exc


def _lark_json(schema: dict[str, Any]) -> str:
    """A tool argument value: fixed separators, as templates write them. With flexible whitespace a
    model can pad a value forever and never close it."""
    return "%json " + json.dumps({**schema, "x-guidance": TOOL_JSON_OPTIONS}, ensure_ascii=False)


def _closed(schema: dict[str, Any]) -> dict[str, Any]:
    """A tool's parameters with no keys of the model's own: an object schema that lists its
    `properties` and says nothing of others gets `additionalProperties: false` (the held-out run
    through the API, 2026-12-04: a call `set_timer {"minutes": 0, "from": "Januappy"}`, which a tool
    would reject). A schema that allows other keys, or names none, is kept as written."""
    if schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema:
        return {**schema, "additionalProperties": False}
    return schema


def _lark_string(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _token(token_id: int) -> str:
    return f"<[{token_id}]>"


def _forced_tools(request: GenerateRequest) -> list[Tool]:
    choice, tools = request.tool_choice, request.tools or []
    if choice is None or choice.mode in ("auto", "none"):
        return []
    if not tools:
        raise InvalidRequest("tool_choice forces a tool call but no tools were given")
    if choice.mode == "function":
        tools = [t for t in tools if t.name == choice.name]
        if not tools:
            raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not among the tools")
    for tool in tools:
        _object_schema(tool)
    return tools


def _object_schema(tool: Tool) -> tuple[dict[str, Any], set[str]]:
    """A forced tool's properties and required names. Shapes no JSON Schema has are the caller's
    mistake (a 400 naming the tool), not a crash while the grammar is built."""
    schema = tool.parameters or {}
    properties, required = schema.get("properties", {}), schema.get("required", [])
    where = f"tools[{tool.name!r}].parameters"
    kind = schema.get("type", "object")
    if kind != "object" and not (isinstance(kind, list) and "object" in kind):
        raise InvalidRequest(f'{where}.type must be "object": a call\'s arguments are a JSON object')
    if not isinstance(properties, dict) or not all(isinstance(s, dict | bool) for s in properties.values()):
        raise InvalidRequest(f"{where}.properties must map each argument name to a schema")
    if not isinstance(required, list) or not all(isinstance(name, str) for name in required):
        raise InvalidRequest(f"{where}.required must be a list of argument names")
    if any(sub is False for sub in properties.values()):
        raise InvalidRequest(f"{where}.properties: an argument whose schema is false can never be given")
    properties = {key: {} if sub is True else sub for key, sub in properties.items()}  # true: any value
    for key, sub in properties.items():
        for bound in ("minLength", "maxLength"):
            value = sub.get(bound, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise InvalidRequest(f"{where}.properties.{key}.{bound} must be a non-negative integer")
    return properties, set(required)


def _num_previous_calls(request: GenerateRequest) -> int:
    return sum(len(m.tool_calls or []) for m in request.messages or [])


def _kimi_tool_grammar(tools: list[Tool], ids: dict[str, int], first_index: int, max_calls: int) -> str:
    """Calls numbered on from the conversation's count (`functions.NAME:IDX`), up to `max_calls` of them."""
    call_begin, arg_begin, call_end = (
        _token(ids[m]) for m in ("<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>")
    )
    rules = [
        f"args_{i}: {_lark_json(_closed(t.parameters or {'type': 'object'}))}" for i, t in enumerate(tools)
    ]
    for k in range(max_calls):
        names = " | ".join(
            f"{_lark_string(f'functions.{t.name}:{first_index + k}')} {arg_begin} args_{i}"
            for i, t in enumerate(tools)
        )
        more = f" call_{k + 1}?" if k + 1 < max_calls else ""
        rules.append(f"call_{k}: {call_begin} ({names}) {call_end}{more}")
    start = f"start: {_token(ids['<|tool_calls_section_begin|>'])} call_0 {_token(ids['<|tool_calls_section_end|>'])}"
    return "\n".join([start, *rules])


def _alternatives(pattern: str, where: str = "") -> list[str]:
    """A regex's top-level alternatives (split at `|` outside groups, classes and escapes). A
    pattern whose groups do not close, or that ends inside an escape, is refused: wrapped in the
    line's own groups it would close or escape them (`a)|(b` took the anchoring apart)."""
    parts, depth, start, i, in_class = [], 0, 0, 0, False
    while i < len(pattern):
        c = pattern[i]
        if c == "\\":
            if i + 1 == len(pattern):
                raise InvalidRequest(f"{where}.pattern ends in a lone backslash")
            i += 2
            continue
        if in_class:
            in_class = c != "]"
        elif c == "[":
            in_class = True
        elif c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth < 0:
                raise InvalidRequest(f"{where}.pattern closes a group it never opened")
        elif c == "|" and depth == 0:
            parts.append(pattern[start:i])
            start = i + 1
        i += 1
    if depth or in_class:
        raise InvalidRequest(f"{where}.pattern leaves a {'class' if in_class else 'group'} open")
    return [*parts, pattern[start:]]


def _is_end_anchor(alternative: str) -> bool:
    """Ends in an unescaped `$` (`a\\$`: an escaped backslash, then the anchor)."""
    if not alternative.endswith("$"):
        return False
    backslashes = len(alternative[:-1]) - len(alternative[:-1].rstrip("\\"))
    return backslashes % 2 == 0


def _full_match(pattern: str, where: str = "") -> str:
    """A JSON Schema `pattern` (found anywhere in the string, unless anchored by `^` / `$`) as a
    regex the whole line must match, as llguidance's JSON strings read it: each top-level
    alternative anchored or not on its own (`^a|b$`), slashes escaped for a lark regex."""
    anywhere = "[^\\n]*"
    alternatives = []
    for alt in _alternatives(pattern, where):
        start, end = alt.startswith("^"), _is_end_anchor(alt)
        core = alt[1 if start else 0 : len(alt) - 1 if end else len(alt)]
        alternatives.append(f"{'' if start else anywhere}(?:{core}){'' if end else anywhere}")
    regex = "|".join(alternatives)
    return re.sub(r"(\\*)/", lambda m: m[1] + ("/" if len(m[1]) % 2 else "\\/"), regex)


def _glm_string(schema: dict[str, Any], where: str, tokens: list[str] | None = None) -> str:
    """A raw string value (GLM writes strings unquoted): one of the schema's `enum` / its `const` when it
    names them, else one line within its length bounds matching its `pattern` (a token rule added to
    `tokens`: lark intersects regexes only there)."""
    if "const" in schema or "enum" in schema:
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
            raise InvalidRequest(f"{where}: a string's enum must be a non-empty list of strings")
        if any("\n" in v for v in values):
            raise InvalidRequest(f"{where}: a string value the model writes raw cannot hold a newline")
        return " | ".join(_lark_string(v) for v in values)
    low, high = schema.get("minLength", 0), schema.get("maxLength")
    for bound, value in (("minLength", low), ("maxLength", high)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise InvalidRequest(f"{where}.{bound} must be a non-negative integer")  # (a $ref's target too)
    line = f"/[^\\n]{{{low},{'' if high is None else high}}}/"
    pattern = schema.get("pattern")
    if pattern is None:
        return line
    if not isinstance(pattern, str) or tokens is None:
        raise InvalidRequest(f"{where}.pattern must be a string")
    name = f"PATTERN_{len(tokens)}"
    tokens.append(f"{name}: /{_full_match(pattern, where)}/ & {line}")
    return name


def _glm_value(schema: dict[str, Any], where: str, tokens: list[str] | None = None) -> str:
    """A value as GLM writes it: raw for a string or a nullable string (the parser's own test,
    `is_string_typed`; JSON there wrote `"celsius"` with its quotes into the string), `null` for
    null; JSON for anything else. `tokens`: where a `pattern`'s token rule goes."""
    if not is_string_typed(schema):
        return _lark_json(schema)
    if not is_nullable(schema):
        return _glm_string(schema, where, tokens)
    if "const" in schema or "enum" in schema:  # null among the values: the rest are strings
        values = [schema["const"]] if "const" in schema else schema["enum"]
        if not isinstance(values, list):
            raise InvalidRequest(f"{where}: a string's enum must be a non-empty list of strings")
        strings = {k: v for k, v in schema.items() if k not in ("const", "enum")}
        strings["enum"] = [v for v in values if v is not None]
        return f'{_glm_string(strings, where)} | "null"' if strings["enum"] else '"null"'
    return f'{_glm_string(schema, where, tokens)} | "null"'  # length bounds may leave `null` out of the line


def _glm_tool_grammar(tools: list[Tool], ids: dict[str, int], max_calls: int) -> str:
    """Arguments in schema order, the required ones always, the others optional."""
    rules: list[str] = []
    for i, tool in enumerate(tools):
        properties, required = _object_schema(tool)
        pairs: list[str] = []
        for j, (key, sub) in enumerate(properties.items()):
            where = f"tools[{tool.name!r}].parameters.properties.{key}"
            value = _glm_value(resolved(sub, tool.parameters or {}, where), where, rules)
            rules.append(f"value_{i}_{j}: {value}")
            pair = (
                f'{_token(ids["<arg_key>"])} {_lark_string(key)} {_token(ids["</arg_key>"])} "\\n" '
                f'{_token(ids["<arg_value>"])} value_{i}_{j} {_token(ids["</arg_value>"])} "\\n"'
            )
            pairs.append(pair if key in required else f"({pair})?")
        rules.append(f"call_{i}: {_lark_string(tool.name + chr(10))} {' '.join(pairs)}".rstrip())
    alternatives = " | ".join(f"call_{i}" for i in range(len(tools)))
    block = f"{_token(ids['<tool_call>'])} ({alternatives}) {_token(ids['</tool_call>'])}"
    start = f"start: block{'' if max_calls == 1 else f'{{1,{max_calls}}}'}\nblock: {block}"
    return "\n".join([start, *rules])


def _tool_lark(
    request: GenerateRequest,
    tools: list[Tool],
    family: str,
    marker_ids: dict[str, int | None],
    *,
    is_parallel: bool,
) -> str:
    """The family's tool-call grammar in Lark, its `start` rule the calls."""
    ids = {k: v for k, v in marker_ids.items() if v is not None}
    max_calls = MAX_PARALLEL_CALLS if is_parallel and request.parallel_tool_calls else 1
    try:
        if family == "kimi":
            return _kimi_tool_grammar(tools, ids, _num_previous_calls(request), max_calls)
        return _glm_tool_grammar(tools, ids, max_calls)
    except KeyError as exc:
        raise InvalidRequest(f"this model's tokenizer has no tool-call marker {exc}") from exc


def _answer_or_calls(
    request: GenerateRequest, schema: dict[str, Any], family: str, marker_ids: dict[str, int | None]
) -> str:
    """A JSON answer (`schema`) or tool calls, from the first token: `tool_choice: auto` beside a JSON
    `response_format` (the JSON grammar alone left no way to call a tool)."""
    calls = _tool_lark(request, request.tools or [], family, marker_ids, is_parallel=True)
    answer = "%json " + json.dumps({**schema, "x-guidance": JSON_OPTIONS}, ensure_ascii=False)
    lark = "start: answer | calls\nanswer: " + answer + "\n" + re.sub(r"^start:", "calls:", calls, count=1)
    try:
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    except ValueError as exc:
        raise InvalidRequest(f"response_format.json_schema: {public_reason(str(exc))}") from exc


def grammar_for(request: GenerateRequest, family: str, marker_ids: dict[str, int | None]) -> str | None:
    """The llguidance grammar constraining `request`'s output from its first token, or None when
    it starts free (tools offered with `tool_choice` auto get `lazy_tool_grammar_for`; beside a JSON
    `response_format`, a JSON answer or calls from the first token)."""
    forced = _forced_tools(request)
    if forced:
        is_parallel = request.tool_choice is not None and request.tool_choice.mode == "required"
        lark = _tool_lark(request, forced, family, marker_ids, is_parallel=is_parallel)
        return str(llguidance.LLMatcher.grammar_from_lark(lark))
    fmt = request.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        schema: dict[str, Any] = {"type": "object"}
    elif fmt.json_schema is None:
        raise InvalidRequest("response_format.json_schema is required when type is json_schema")
    else:
        schema = fmt.json_schema
    is_auto = request.tool_choice is None or request.tool_choice.mode == "auto"
    if request.tools and is_auto and all(marker_ids.get(m) is not None for m in TOOL_MARKERS[family]):
        return _answer_or_calls(request, schema, family, marker_ids)
    return _json_grammar(schema)


def lazy_tool_grammar_for(
    request: GenerateRequest, family: str, marker_ids: dict[str, int | None], markers: tuple[str, ...]
) -> tuple[str, int, list[int]] | None:
    """For a request with tools and no forced call: (the tool-call grammar; the marker that
    switches it on; the markers kept out of free text). None when there is nothing to constrain:
    no tools offered or `tool_choice: none` (the engine's guard keeps every marker out: see
    `unoffered_markers`), or a tokenizer without markers. `markers` is the family's, the
    call-opening one first."""
    ids = [marker_ids.get(m) for m in markers]
    if not request.tools or any(i is None for i in ids) or _refuses_tools(request):
        return None
    known = [i for i in ids if i is not None]
    lark = _tool_lark(request, request.tools, family, marker_ids, is_parallel=True)
    grammar = str(llguidance.LLMatcher.grammar_from_lark(lark))
    return grammar, known[0], known[1:]


def unoffered_markers(
    request: GenerateRequest, marker_ids: dict[str, int | None], markers: tuple[str, ...]
) -> list[int]:
    """The family's tool-call marker ids a chat may not write: all of them where no tool is
    offered or `tool_choice` is none (the model's call would otherwise reach the text, its markup
    stripped or not: issue 26), none where a call may be made or the prompt is raw."""
    if request.messages is None or (request.tools and not _refuses_tools(request)):
        return []
    return [i for i in (marker_ids.get(m) for m in markers) if i is not None]


def _refuses_tools(request: GenerateRequest) -> bool:
    return request.tool_choice is not None and request.tool_choice.mode == "none"


def build_constraint(
    grammar: str, tokenizer: llguidance.LLTokenizer, what: str = "response format"
) -> GrammarConstraint:
    """Compile `grammar` for `tokenizer`; a grammar llguidance refuses is a 400 that names `what`
    it was built from and gives its reason but none of the grammar (see `public_reason`)."""
    message = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
    if message and not message.startswith("WARNING"):
        raise InvalidRequest(f"{what} cannot be compiled: {public_reason(message)}")
    matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
    if matcher.is_error():
        raise InvalidRequest(f"{what} cannot be compiled: {public_reason(matcher.get_error())}")
    matcher.compute_bitmask()  # a schema no value satisfies (`{"$ref": "#"}`) fails on its first token
    if matcher.is_error():  # (its error is the matcher's state dump, grammar included: not the caller's)
        raise InvalidRequest(f"{what} cannot be satisfied: no output matches it")
    return GrammarConstraint(matcher)


_GRAMMAR_LISTING = re.compile(r"^\s*\d+ \| |^\s*\^\s*$")  # llguidance's numbered source lines, caret
_GRAMMAR_POSITION = re.compile(r"^at \d+\(\d+\): ")
_TOKEN_REFERENCE = re.compile(r"<\[\d+\]>")


def public_reason(message: str) -> str:
    """llguidance's error without the internal grammar: it quotes the grammar we composed (the
    family's call syntax with its special-token ids, `<[821]>`) around the failing line, and
    points at a position in it. Only the reason is the caller's business."""
    lines = [line.rstrip() for line in message.splitlines() if not _GRAMMAR_LISTING.match(line)]
    reason = _GRAMMAR_POSITION.sub("", "\n".join(line for line in lines if line).strip())
    return _TOKEN_REFERENCE.sub("<token>", reason)

"""Constrained decoding: whatever the logits, the output parses and validates against the schema,
and forced tool calls come out in the family's syntax that its parser reads back."""

from __future__ import annotations

import json
import re
from typing import Annotated, Literal

import jsonschema_rs
import msgspec
import pytest
import torch

from backend.engine.constraint import TokenGuard
from backend.errors import InvalidRequest
from backend.server.model_card import TOOL_MARKERS
from backend.text.structured import (
    MAX_PARALLEL_CALLS,
    GrammarConstraint,
    LazyToolConstraint,
    _full_match,
    build_constraint,
    grammar_for,
    lazy_tool_grammar_for,
    unoffered_markers,
)
from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers import MARKERS, ParsedCall, parser_for
from schemas.backend import (
    EngineRequest,
    GenerateRequest,
    Message,
    ResponseFormat,
    Tool,
    ToolCall,
    ToolCallFunction,
    ToolChoice,
)
from tests.backend.server_tokenizers import load, ordinary_ids
from tests.backend.text.test_tool_parsers import _glm_call, _kimi_call

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}


class Person(msgspec.Struct, forbid_unknown_fields=True):
    """An independent statement of SCHEMA, checked by msgspec."""

    name: Annotated[str, msgspec.Meta(max_length=6)]
    age: Annotated[int, msgspec.Meta(ge=0, le=120)]
    tags: Annotated[list[Literal["a", "b"]], msgspec.Meta(max_length=3)]
    ok: bool


WEATHER = Tool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
)


def _request(**kwargs: object) -> GenerateRequest:
    return GenerateRequest(
        request_id="r", tenant_salt="0" * 16, messages=[Message(role="user", content="hi")], **kwargs
    )  # type: ignore[arg-type]


def _markers(tok: Tokenizer) -> dict[str, int | None]:
    return {n: tok.token_to_id(n) for n in TOOL_MARKERS}


_MARKER_IDS: dict[str, int | None] = {n: 1000 + i for i, n in enumerate(TOOL_MARKERS)}  # grammar text only


def _walk(constraint: GrammarConstraint, vocab: int, eos: int, seed: int, max_steps: int = 400) -> list[int]:
    """Sample from random logits under the mask until the constraint finishes (a random-weights model)."""
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_steps):
        mask = constraint.allowed_tokens(vocab)
        assert mask is not None and mask.any()
        logits = torch.randn(vocab, generator=gen).masked_fill(~mask, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        constraint.accept(token)
        if token == eos:
            break
        out.append(token)
        if constraint.is_finished():
            break
    assert constraint.is_finished() and constraint.error is None
    return out


@pytest.mark.parametrize("layout", ["kimi-tiktoken", "glm"])
@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(
    tmp_path_factory: pytest.TempPathFactory, layout: str, seed: int
) -> None:
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    vocab = tok.vocab_size + 13  # model embeddings are often padded past the tokenizer
    grammar = grammar_for(
        _request(response_format=ResponseFormat(type="json_schema", json_schema=SCHEMA)), "kimi", {}
    )
    assert grammar is not None
    ids = _walk(build_constraint(grammar, tok.ll_tokenizer(vocab, [eos])), vocab, eos, seed)
    msgspec.json.decode(tok.decode(ids), type=Person)


def test_json_object_mode_yields_an_object(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    eos = tok.named_id("eos_token")
    assert eos is not None
    grammar = grammar_for(_request(response_format=ResponseFormat(type="json_object")), "glm", {})
    assert grammar is not None
    constraint = build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos]))
    mask = constraint.allowed_tokens(tok.vocab_size)
    assert mask is not None
    allowed_text = {tok.decode([int(i)]) for i in mask.nonzero().flatten()}
    assert allowed_text and all(t.lstrip().startswith("{") for t in allowed_text)
    for token in tok.encode('{"a":[1,{"b":null}]}'):  # compact: the grammar fixes the separators
        constraint.accept(token)
    assert constraint.error is None
    constraint.accept(eos)
    assert constraint.is_finished() and constraint.error is None


@pytest.mark.parametrize("schema", [{"type": "strnig"}, {"$ref": "#/definitions/missing"}])
def test_uncompilable_schema_is_a_400(
    tmp_path_factory: pytest.TempPathFactory, schema: dict[str, object]
) -> None:
    tok = load(tmp_path_factory, "glm")
    with pytest.raises(InvalidRequest) as info:
        grammar = grammar_for(
            _request(response_format=ResponseFormat(type="json_schema", json_schema=schema)), "glm", {}
        )
        assert grammar is not None
        build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]))
    assert info.value.status == 400


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
@pytest.mark.parametrize("seed", range(3))
def test_forced_tool_call_parses_back(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str, seed: int
) -> None:
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    other = Tool(name="other", parameters={"type": "object", "properties": {}})
    request = _request(tools=[other, WEATHER], tool_choice=ToolChoice(mode="function", name="get_weather"))
    grammar = grammar_for(request, family, _markers(tok))
    assert grammar is not None
    ids = _walk(build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos])), tok.vocab_size, eos, seed)
    parser = parser_for(family, tok, [other, WEATHER])
    assert parser is not None
    pieces = parser.feed(ids) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    assert len(calls) == 1, pieces
    assert calls[0].name == "get_weather"
    arguments = json.loads(calls[0].arguments)
    assert set(arguments) == {"city", "days"} and isinstance(arguments["city"], str)
    assert 1 <= arguments["days"] <= 9
    if family == "kimi":
        assert calls[0].id == "functions.get_weather:0"


CURRENCY = Tool(
    name="convert_currency",
    parameters={
        "type": "object",
        "properties": {
            "amount": {"type": "number"},
            "from": {"type": "string", "enum": ["USD", "EUR", "GBP"]},
            "to": {"type": "string", "const": "JPY"},
        },
        "required": ["amount", "from", "to"],
        "additionalProperties": False,
    },
)


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
@pytest.mark.parametrize("seed", range(6))
def test_a_forced_call_keeps_string_arguments_to_their_enum(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str, seed: int
) -> None:
    """A string argument with an `enum` or `const` gets one of those values whatever the logits (GLM writes
    strings raw: its grammar once let any line through, and the trained nano GLM wrote `to: 481`)."""
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    grammar = grammar_for(
        _request(tools=[CURRENCY], tool_choice=ToolChoice(mode="required")), family, _markers(tok)
    )
    assert grammar is not None
    ids = _walk(build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos])), tok.vocab_size, eos, seed)
    parser = parser_for(family, tok, [CURRENCY])
    assert parser is not None
    calls = [p for p in parser.feed(ids) + parser.finish() if isinstance(p, ParsedCall)]
    assert calls
    for call in calls:
        arguments = json.loads(call.arguments)
        assert arguments["from"] in ("USD", "EUR", "GBP") and arguments["to"] == "JPY", arguments


@pytest.mark.parametrize("enum", [[], [1, 2], ["a\nb"]])
def test_a_string_enum_glm_cannot_write_is_a_400(enum: list[object]) -> None:
    tool = Tool(
        name="pick", parameters={"type": "object", "properties": {"x": {"type": "string", "enum": enum}}}
    )
    with pytest.raises(InvalidRequest, match="pick") as info:
        grammar_for(_request(tools=[tool], tool_choice=ToolChoice(mode="required")), "glm", _MARKER_IDS)
    assert info.value.status == 400


def test_forcing_an_unknown_tool_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        grammar_for(
            _request(tools=[WEATHER], tool_choice=ToolChoice(mode="function", name="nope")), "kimi", {}
        )
    with pytest.raises(InvalidRequest):
        grammar_for(_request(tool_choice=ToolChoice(mode="required")), "kimi", {})


@pytest.mark.parametrize(
    ("parameters", "words"),
    [
        ({"type": "object", "properties": ["city"]}, "properties"),
        ({"type": "object", "properties": {"city": "a string"}}, "properties"),
        ({"type": "object", "properties": {}, "required": "city"}, "required"),
        ({"type": "object", "properties": {"city": {"type": "string", "maxLength": "12"}}}, "maxLength"),
    ],
)
def test_a_malformed_tool_schema_in_a_forced_call_is_a_400_naming_the_tool(
    parameters: dict[str, object], words: str
) -> None:
    tool = Tool(name="get_weather", parameters=parameters)
    for family in ("glm", "kimi"):
        request = _request(tools=[tool], tool_choice=ToolChoice(mode="required"))
        with pytest.raises(InvalidRequest, match=words) as info:
            grammar = grammar_for(request, family, _MARKER_IDS)
            assert grammar is not None  # kimi hands the schema to llguidance, which must refuse it too
            raise AssertionError(f"{family} accepted {parameters}")
        assert info.value.status == 400 and "get_weather" in info.value.message


def test_a_boolean_property_schema_is_valid_in_a_forced_glm_call() -> None:
    tool = Tool(name="echo", parameters={"type": "object", "properties": {"x": True}, "required": ["x"]})
    assert grammar_for(_request(tools=[tool], tool_choice=ToolChoice(mode="required")), "glm", _MARKER_IDS)


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
def test_required_allows_parallel_calls_numbered_on(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str
) -> None:
    """`required` with parallel calls: 1..4 calls of any tool, Kimi ids continuing the history's count."""
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    note = Tool(
        name="note",
        parameters={
            "type": "object",
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
            "additionalProperties": False,
        },
    )
    history = [
        Message(role="user", content="hi"),
        Message(
            role="assistant",
            tool_calls=[
                ToolCall(id="functions.note:0", function=ToolCallFunction(name="note", arguments="{}"))
            ],
        ),
        Message(role="tool", tool_call_id="functions.note:0", content="ok"),
    ]
    request = GenerateRequest(
        request_id="r",
        tenant_salt="0" * 16,
        messages=history,
        tools=[WEATHER, note],
        tool_choice=ToolChoice(mode="required"),
    )
    grammar = grammar_for(request, family, _markers(tok))
    assert grammar is not None
    counts = set()
    for seed in range(16):
        ids = _walk(
            build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos])), tok.vocab_size, eos, seed
        )
        parser = parser_for(family, tok, [WEATHER, note])
        assert parser is not None
        pieces = parser.feed(ids) + parser.finish()
        calls = [p for p in pieces if isinstance(p, ParsedCall)]
        assert 1 <= len(calls) <= 4 and len(calls) == len(pieces), pieces
        assert all(c.name in ("get_weather", "note") for c in calls)
        if family == "kimi":
            assert [c.id.rsplit(":", 1)[1] for c in calls] == [str(1 + k) for k in range(len(calls))]
        counts.add(len(calls))
    assert counts == set(range(1, MAX_PARALLEL_CALLS + 1))  # random logits use all the room


def test_forced_kimi_call_cannot_be_padded_with_whitespace_forever(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A sampler that always prefers whitespace still reaches the end of the call: the arguments'
    JSON is compact, so a bounded string argument bounds the whole call."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    tool = Tool(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    )
    request = GenerateRequest(
        request_id="ws",
        tenant_salt="ab" * 8,
        messages=[Message(role="user", content="hi")],
        tools=[tool],
        tool_choice=ToolChoice(mode="function", name="get_weather"),
    )
    ids = {m: tok.token_to_id(m) for m in TOOL_MARKERS}
    n = tok.vocab_size
    constraint = build_constraint(
        grammar_for(request, "kimi", ids), tok.ll_tokenizer(n, [tok.token_to_id("[EOS]")])
    )
    whitespace = [i for i in range(n) if tok.decode([i]).isspace()]
    assert whitespace
    for _ in range(200):
        if constraint.is_finished():
            break
        mask = constraint.allowed_tokens(n)
        pick = next((w for w in whitespace if mask[w]), int(mask.nonzero()[-1]))
        constraint.accept(pick)
    assert constraint.is_finished()


def _lazy(request: GenerateRequest, tok: Tokenizer, family: str, eos: int) -> LazyToolConstraint:
    lazy = lazy_tool_grammar_for(request, family, _markers(tok), MARKERS[family])
    assert lazy is not None
    grammar, trigger_id, banned_ids = lazy
    return LazyToolConstraint(
        build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos])), trigger_id, banned_ids
    )


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
@pytest.mark.parametrize("seed", range(5))
def test_auto_tool_calls_switch_the_grammar_on_at_the_marker(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str, seed: int
) -> None:
    """`tool_choice: auto`: free text (the other markers masked out) until the model opens a call;
    from there the call names an offered tool with arguments valid under its schema (checked by
    jsonschema_rs, not by the grammar's own library)."""
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    # bounded numbers: random logits would otherwise write exponents no float holds
    currency = Tool(
        name="convert_currency",
        parameters={**(CURRENCY.parameters or {}), "properties": {
            **(CURRENCY.parameters or {})["properties"], "amount": {"type": "number", "minimum": 0, "maximum": 1e6}
        }},
    )  # fmt: skip
    tools = [WEATHER, currency]
    request = _request(tools=tools, tool_choice=ToolChoice(mode="auto"))
    constraint = _lazy(request, tok, family, eos)
    trigger, *others = (tok.token_to_id(m) for m in MARKERS[family])
    gen = torch.Generator().manual_seed(seed)
    free = tok.encode("Let me check. ", allow_special=False)
    for token in free:
        mask = constraint.allowed_tokens(tok.vocab_size)
        assert mask is not None and mask[token] and mask[trigger] and not any(mask[o] for o in others)
        constraint.accept(token)
    assert not constraint.is_finished()
    constraint.accept(trigger)  # the model opens a call
    ids = [trigger]
    for _ in range(400):
        mask = constraint.allowed_tokens(tok.vocab_size)
        assert mask is not None and mask.any()
        logits = torch.randn(tok.vocab_size, generator=gen).masked_fill(~mask, float("-inf"))
        token = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        constraint.accept(token)
        if token == eos:
            break
        ids.append(token)
        if constraint.is_finished():
            break
    assert constraint.is_finished()
    parser = parser_for(family, tok, tools)
    assert parser is not None
    pieces = parser.feed(free + ids) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    assert calls and all(c.name in ("get_weather", "convert_currency") for c in calls), pieces
    schemas = {t.name: jsonschema_rs.validator_for(t.parameters) for t in tools}
    for call in calls:
        assert schemas[call.name].is_valid(json.loads(call.arguments)), call
    if family == "kimi":
        assert [c.id for c in calls] == [f"functions.{c.name}:{k}" for k, c in enumerate(calls)]


def test_auto_rolls_back_across_the_marker(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Preemption by recompute rolls back past the call's opening: the constraint is free again and
    replaying the same tokens brings it to the same state."""
    tok = load(tmp_path_factory, "glm")
    eos = tok.named_id("eos_token")
    assert eos is not None
    constraint = _lazy(_request(tools=[WEATHER]), tok, "glm", eos)
    free = tok.encode("Hi ", allow_special=False)
    opening = tok.encode("<tool_call>") + tok.encode("get_weather\n", allow_special=False)
    for token in free + opening:
        constraint.accept(token)
    constrained = constraint.allowed_tokens(tok.vocab_size)
    assert constrained is not None and not constrained.all()
    constraint.rollback(len(opening) + 1)
    assert not constraint.is_triggered
    for token in [free[-1], *opening]:
        constraint.accept(token)
    again = constraint.allowed_tokens(tok.vocab_size)
    assert again is not None and torch.equal(again, constrained)


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
def test_a_chat_that_may_call_no_tool_keeps_every_marker_out(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str
) -> None:
    """No tools offered, or `tool_choice: none`: no grammar, the engine's token guard bans every
    marker of the family (an unoffered call would reach the text, issue 26); plain text and the
    end of turn stay allowed. Tools offered, or a raw prompt: nothing banned."""
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    every = [tok.token_to_id(m) for m in MARKERS[family]]
    assert None not in every
    for request in (_request(), _request(tools=[WEATHER], tool_choice=ToolChoice(mode="none"))):
        assert lazy_tool_grammar_for(request, family, _markers(tok), MARKERS[family]) is None
        banned = unoffered_markers(request, _markers(tok), MARKERS[family])
        assert sorted(banned) == sorted(every)
        guard = TokenGuard.of(EngineRequest(request_id="r", prompt_token_ids=[1], tenant_salt="0" * 16,
                                            eos_token_ids=[eos], banned_token_ids=banned))  # fmt: skip
        assert guard is not None
        for token in tok.encode("plain words", allow_special=False):
            mask = guard.allowed_tokens(tok.vocab_size)
            assert mask is not None and mask[token] and mask[eos]
            assert not any(mask[t] for t in every)
            guard.accept(token)
    assert unoffered_markers(_request(tools=[WEATHER]), _markers(tok), MARKERS[family]) == []
    raw = GenerateRequest(request_id="r", tenant_salt="0" * 16, prompt="hi", raw=True)
    assert unoffered_markers(raw, _markers(tok), MARKERS[family]) == []


def _kimi_call_is_allowed(tok: Tokenizer, tool: Tool, arguments: str) -> bool:
    """Whether the grammar of a call forced to `tool` accepts, token by token, one call of it
    with `arguments` written as given."""
    request = _request(tools=[tool], tool_choice=ToolChoice(mode="function", name=tool.name))
    ids = {m: tok.token_to_id(m) for m in TOOL_MARKERS}
    n = tok.vocab_size
    constraint = build_constraint(
        grammar_for(request, "kimi", ids), tok.ll_tokenizer(n, [tok.token_to_id("[EOS]")])
    )
    call = [ids["<|tool_calls_section_begin|>"], ids["<|tool_call_begin|>"]]
    call += tok.encode(f"functions.{tool.name}:0") + [ids["<|tool_call_argument_begin|>"]]
    call += tok.encode(arguments) + [ids["<|tool_call_end|>"], ids["<|tool_calls_section_end|>"]]
    for token in call:
        mask = constraint.allowed_tokens(n)
        if mask is None or not mask[token]:
            return False
        constraint.accept(token)
    return constraint.is_finished()


@pytest.mark.parametrize(
    ("arguments", "is_allowed"),
    [('{"city": "Paris", "unit": "c"}', True), ('{"city":"Paris","unit":"c"}', False)],
)
def test_forced_kimi_arguments_are_written_as_templates_write_them(
    tmp_path_factory: pytest.TempPathFactory, arguments: str, is_allowed: bool
) -> None:
    """Tool arguments take json.dumps' separators (", " and ": "), the form the chat templates render
    and the models learnt; compact JSON is not what a model trained on them writes."""
    tool = Tool(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
            "required": ["city", "unit"],
        },
    )
    assert _kimi_call_is_allowed(load(tmp_path_factory, "kimi-tiktoken"), tool, arguments) == is_allowed


@pytest.mark.parametrize(
    ("extra", "is_allowed"), [({}, False), ({"additionalProperties": True}, True)], ids=["closed", "open"]
)
def test_forced_kimi_arguments_add_no_keys_of_their_own(
    tmp_path_factory: pytest.TempPathFactory, extra: dict[str, object], is_allowed: bool
) -> None:
    """A key the tool did not declare is refused, unless its schema says other keys are welcome."""
    properties = {"minutes": {"type": "integer"}}
    tool = Tool(name="set_timer", parameters={"type": "object", "properties": properties, **extra})
    tok = load(tmp_path_factory, "kimi-tiktoken")
    assert _kimi_call_is_allowed(tok, tool, '{"minutes": 3, "from": "x"}') == is_allowed
    assert _kimi_call_is_allowed(tok, tool, '{"minutes": 3}')  # its own key always


UNITS = Tool(
    name="set_units",
    parameters={
        "type": "object",
        "properties": {"units": {"type": ["string", "null"], "enum": ["celsius", "fahrenheit", None]}},
        "required": ["units"],
    },
)


@pytest.mark.parametrize("seed", range(6))
def test_glm_nullable_strings_come_back_as_strings_or_null(
    tmp_path_factory: pytest.TempPathFactory, seed: int
) -> None:
    """GLM writes strings raw; a nullable string's grammar was JSON (`"celsius"`, quotes and all, which the
    parser kept inside the string) and `null` came back as the string "null". Now the grammar writes it
    as the parser reads it: the value raw, or `null` for null."""
    tok = load(tmp_path_factory, "glm")
    eos = tok.named_id("eos_token")
    assert eos is not None
    grammar = grammar_for(
        _request(tools=[UNITS], tool_choice=ToolChoice(mode="required")), "glm", _markers(tok)
    )
    assert grammar is not None
    ids = _walk(build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos])), tok.vocab_size, eos, seed)
    parser = parser_for("glm", tok, [UNITS])
    assert parser is not None
    calls = [p for p in parser.feed(ids) + parser.finish() if isinstance(p, ParsedCall)]
    assert calls
    for call in calls:
        assert json.loads(call.arguments)["units"] in ("celsius", "fahrenheit", None), call.arguments


@pytest.mark.parametrize("bounds", [{"minLength": 5}, {"maxLength": 3}, {}])
def test_a_bounded_nullable_string_can_still_be_null(
    tmp_path_factory: pytest.TempPathFactory, bounds: dict
) -> None:  # type: ignore[type-arg]
    """`null` is four characters: a nullable string whose length bounds leave it out of the raw line
    still takes `null` (the grammar once only allowed the line), and the parser reads it as None."""
    tok = load(tmp_path_factory, "glm")
    eos = tok.named_id("eos_token")
    assert eos is not None
    tool = Tool(
        name="pick",
        parameters={
            "type": "object",
            "properties": {"v": {"type": ["string", "null"], **bounds}},
            "required": ["v"],
        },
    )
    grammar = grammar_for(
        _request(tools=[tool], tool_choice=ToolChoice(mode="required")), "glm", _markers(tok)
    )
    assert grammar is not None
    constraint = build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos]))
    ids = _glm_call(tok, "pick", [("v", "null")])
    for token_id in ids:
        assert constraint.error is None
        constraint.accept(token_id)
    assert constraint.error is None
    parser = parser_for("glm", tok, [tool])
    assert parser is not None
    (call,) = [p for p in parser.feed(ids) + parser.finish() if isinstance(p, ParsedCall)]
    assert json.loads(call.arguments) == {"v": None}


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
def test_a_json_format_beside_offered_tools_allows_a_json_answer_or_a_call(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str
) -> None:
    """`tool_choice: auto` with a JSON `response_format`: the answer is JSON of the schema or tool calls
    (the JSON grammar alone applied from the first token, so no tool could be called); forced tools
    keep their call grammar, and a model without markers the JSON grammar."""
    tok = load(tmp_path_factory, layout)
    eos = tok.named_id("eos_token")
    assert eos is not None
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    fmt = ResponseFormat(type="json_schema", json_schema=schema)
    grammar = grammar_for(_request(tools=[WEATHER], response_format=fmt), family, _markers(tok))
    assert grammar is not None
    if family == "kimi":
        call = (
            tok.encode("<|tool_calls_section_begin|>")
            + _kimi_call(tok, "functions.get_weather:0", '{"city": "Oslo", "days": 2}')
            + tok.encode("<|tool_calls_section_end|>")
        )
    else:
        call = _glm_call(tok, "get_weather", [("city", "Oslo"), ("days", "2")])
    for ids in (call, ordinary_ids(tok, '{"n":7}')):  # compact, as JSON mode writes it
        constraint = build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos]))
        for token_id in ids:
            constraint.accept(token_id)
            assert constraint.error is None, tok.decode(ids)
        mask = constraint.allowed_tokens(tok.vocab_size)
        assert mask is not None and bool(mask[eos]), tok.decode(ids)  # complete: it may end there
    text_only = ordinary_ids(tok, "Sure, ")
    constraint = build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos]))
    mask = constraint.allowed_tokens(tok.vocab_size)
    assert mask is not None and not bool(mask[text_only[0]])  # neither JSON nor a call
    forced = _request(tools=[WEATHER], response_format=fmt, tool_choice=ToolChoice(mode="required"))
    assert grammar_for(forced, family, _markers(tok)) != grammar
    assert grammar_for(_request(tools=[WEATHER], response_format=fmt), family, {}) == grammar_for(
        _request(response_format=fmt), family, {}
    )


@pytest.mark.parametrize(("layout", "family"), [("glm", "glm"), ("kimi-tiktoken", "kimi")])
def test_tool_parameters_that_are_not_an_object_schema_are_a_400(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str
) -> None:
    """A call's arguments are a JSON object: `parameters: {"type": "banana"}` is refused (GLM's call
    grammar reads only the properties, and took it silently)."""
    tok = load(tmp_path_factory, layout)
    bad = Tool(name="t", parameters={"type": "banana"})
    request = _request(tools=[bad], tool_choice=ToolChoice(mode="required"))
    with pytest.raises(InvalidRequest) as info:
        grammar = grammar_for(request, family, _markers(tok))
        assert grammar is not None
        build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]), "tool parameters")
    message = info.value.message
    assert info.value.status == 400 and ("banana" in message or '"object"' in message)


def _forced(parameters: dict[str, object]) -> GenerateRequest:
    return _request(
        tools=[Tool(name="get_weather", parameters=parameters)],
        tool_choice=ToolChoice(mode="function", name="get_weather"),
    )


@pytest.mark.parametrize("seed", range(4))
def test_glm_arguments_follow_refs_and_patterns(tmp_path_factory: pytest.TempPathFactory, seed: int) -> None:
    """GLM compiles each argument alone: a `$ref` into the parameters' `$defs` (pydantic's nested
    models) is followed there, and a string's `pattern` holds (JSON Schema's: found anywhere unless
    anchored), as for Kimi, whose arguments are one JSON schema (the probe of 2026-12-07: a 400
    "Pointer '/$defs/City' does not exist", and `"city": "Tokyo"` for `^[0-9]{3}$`)."""
    tok = load(tmp_path_factory, "glm")
    eos = tok.named_id("eos_token")
    assert eos is not None
    parameters = {
        "type": "object",
        "$defs": {
            "Code": {"type": "string", "pattern": "^[0-9]{3}$"},
            "Where": {
                "type": "object",
                "properties": {"n": {"$ref": "#/$defs/Count"}},
                "required": ["n"],
                "additionalProperties": False,
            },
            "Count": {"type": "integer", "minimum": 1, "maximum": 9},
        },
        "properties": {
            "code": {"$ref": "#/$defs/Code"},
            "tag": {"type": "string", "pattern": "a/b", "maxLength": 8},
            "where": {"$ref": "#/$defs/Where"},
        },
        "required": ["code", "tag", "where"],
    }
    grammar = grammar_for(_forced(parameters), "glm", _markers(tok))
    assert grammar is not None
    ids = _walk(build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [eos])), tok.vocab_size, eos, seed)
    parser = parser_for("glm", tok, [Tool(name="get_weather", parameters=parameters)])
    assert parser is not None
    calls = [p for p in parser.feed(ids) + parser.finish() if isinstance(p, ParsedCall)]
    assert len(calls) == 1, tok.decode(ids)
    arguments = json.loads(calls[0].arguments)
    jsonschema_rs.validate(parameters, arguments)  # an independent validator: refs, pattern and all
    assert "\n" not in arguments["tag"]


@pytest.mark.parametrize(
    ("parameters", "reason"),
    [
        (
            {"type": "object", "properties": {"city": {"type": "string", "pattern": "(("}}},
            "leaves a group open",
        ),
        (
            {"type": "object", "properties": {"city": {"type": "string", "pattern": "a{2,1}"}}},
            "invalid regex",
        ),
        ({"type": "object", "properties": {"city": {"$ref": "#/$defs/Nope"}}}, "does not exist"),
    ],
)
def test_a_glm_argument_schema_that_cannot_hold_is_a_400(
    tmp_path_factory: pytest.TempPathFactory, parameters: dict[str, object], reason: str
) -> None:
    tok = load(tmp_path_factory, "glm")
    with pytest.raises(InvalidRequest, match=reason) as info:
        grammar = grammar_for(_forced(parameters), "glm", _markers(tok))
        assert grammar is not None
        build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]), "tool parameters")
    assert info.value.status == 400 and "<[" not in str(info.value)


def test_a_format_no_value_satisfies_is_a_400(tmp_path_factory: pytest.TempPathFactory) -> None:
    """`{"$ref": "#"}` (the probe of 2026-12-07: a 200 with empty content and `finish_reason: stop`)."""
    tok = load(tmp_path_factory, "glm")
    request = _request(response_format=ResponseFormat(type="json_schema", json_schema={"$ref": "#"}))
    grammar = grammar_for(request, "glm", {})
    assert grammar is not None
    with pytest.raises(InvalidRequest, match="cannot be satisfied") as info:
        build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]))
    assert "grammar" not in str(info.value) and "state" not in str(info.value)


def test_a_grammar_that_stops_the_output_says_why_in_the_callers_words(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A matcher that hit one of llguidance's limits (here made tiny; a schema that requires itself
    hits the default one) or took a token its grammar refuses: the reason in the caller's words,
    not llguidance's message (which quotes the grammar and its limits)."""
    import llguidance

    tok = load(tmp_path_factory, "glm")
    ll = tok.ll_tokenizer(tok.vocab_size, [0])
    grammar = llguidance.LLMatcher.grammar_from_json_schema({"type": "array", "items": {"type": "integer"}})
    limits = llguidance.LLParserLimits(max_items_in_row=3, step_max_items=5)
    constraint = GrammarConstraint(llguidance.LLMatcher(ll, grammar, log_level=0, limits=limits))
    assert constraint.error is None
    for token in tok.encode("[1,2,3,4,5,6,7,8,9,10,11,12,13", allow_special=False):
        constraint.allowed_tokens(tok.vocab_size)
        constraint.accept(token)
        if constraint.error is not None:
            break
    dead = GrammarConstraint(llguidance.LLMatcher(ll, grammar, log_level=0))
    dead.accept(tok.encode("x", allow_special=False)[0])  # a token the grammar never allows
    for failed in (constraint, dead):
        assert failed.error is not None and failed.error.startswith("The response format or tool parameters")
        assert "limit" not in failed.error and "ff_tokens" not in failed.error


PATTERNS = [
    r"^a|b$",
    r"^ab|cd",
    r"a\\$",
    r"^https?:\/\/",
    "a/b",
    r"x(y|z)",
    r"^[0-9]{3}$",
    r"[|]q",
    r"\d+\/\d+",
]
SAMPLES = ["a", "axyz", "zzb", "b", "ab", "xcd", "a\\", "https://x", "http:/", "a/b", "xa/by", "xy", "xz!", "123",
           "1234", "|q", "q", "12/34", "12-34", ""]  # fmt: skip


@pytest.mark.parametrize("pattern", PATTERNS)
def test_a_glm_pattern_matches_what_json_schema_finds(pattern: str) -> None:
    """JSON Schema's `pattern` is found anywhere unless anchored, alternative by alternative; GLM's raw
    strings must match it whole, so `_full_match` rewrites it (the review of 09e35e7: `^a|b$` read as
    `^(a|b)$`, `\\/` escaped twice into a lexer error, `a\\\\$` taken for a literal `$`). Python's
    `re.search` is the reference (these patterns mean the same in ECMA and Python regexes)."""
    full = _full_match(pattern)
    for sample in SAMPLES:
        assert bool(re.fullmatch(full, sample)) == bool(re.search(pattern, sample)), (pattern, sample, full)


@pytest.mark.parametrize(
    ("pattern", "reason"),
    [
        ("a)|(b", "closes a group it never opened"),
        ("(a", "leaves a group open"),
        ("[ab", "leaves a class open"),
        ("abc\\", "ends in a lone backslash"),
    ],
)
def test_a_glm_pattern_that_would_break_out_of_its_wrapping_is_a_400(pattern: str, reason: str) -> None:
    """Wrapped in the line's own groups, `a)|(b` closed them and took the anchoring apart, and a
    trailing backslash escaped the wrapper (the error then quoted the grammar's regex)."""
    with pytest.raises(InvalidRequest, match=f"^tools.city.pattern {reason}$".replace(".", "[.]")):
        _full_match(pattern, "tools.city")
    assert _full_match("(a)|[)(]\\)", "x")  # balanced, a class's and an escape's parens aside


def test_glm_refs_to_no_schema_are_400s_and_plain_arguments_carry_no_definitions(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tok = load(tmp_path_factory, "glm")
    defs = {f"D{i}": {"type": "object", "properties": {"x": {"type": "integer"}}} for i in range(50)}
    defs |= {"Any": True, "Never": False, "Bad": {"type": "string", "minLength": "x"}}
    for target, reason in [("Never", "can never be given"), ("Bad", "minLength"), ("nope", "does not exist")]:
        parameters = {"type": "object", "$defs": defs, "properties": {"a": {"$ref": f"#/$defs/{target}"}}}
        with pytest.raises(InvalidRequest, match=reason):
            grammar_for(_forced(parameters), "glm", _markers(tok))
    with pytest.raises(InvalidRequest, match="names no schema"):
        grammar_for(_forced({"type": "object", "required": ["a"], "properties": {"a": {"$ref": "#/required"}}}), "glm", _markers(tok))  # fmt: skip
    plain = {
        "type": "object",
        "$defs": defs,
        "properties": {"a": {"$ref": "#/$defs/Any"}, "n": {"type": "integer"}},
    }
    grammar = grammar_for(_forced(plain), "glm", _markers(tok))
    assert grammar is not None and "D49" not in grammar  # no ref left: no definitions copied in
    build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]), "tool parameters")
    url = {
        "type": "object",
        "properties": {"u": {"type": "string", "pattern": r"^https?:\/\/"}},
        "required": ["u"],
    }
    grammar = grammar_for(_forced(url), "glm", _markers(tok))
    assert grammar is not None
    build_constraint(grammar, tok.ll_tokenizer(tok.vocab_size, [0]), "tool parameters")  # compiles

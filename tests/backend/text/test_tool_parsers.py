"""Golden tool-call parsing for both families, fed token sequences as the model would write them."""

from __future__ import annotations

import json
import random

import pytest

from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers import ContentIds, ParsedCall, Piece, RawText, parser_for
from backend.text.tool_parsers.glm import MARKERS as GLM_MARKERS
from backend.text.tool_parsers.kimi import MARKERS as KIMI_MARKERS
from schemas.backend import Tool
from tests.backend.server_tokenizers import load, ordinary_ids

TOOLS = [
    Tool(
        name="get_weather",
        parameters={
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "units": {"type": ["string", "null"]},
                "hourly": {"type": "boolean"},
                "spots": {"type": "array"},
            },
        },
    ),
    Tool(name="search", parameters={"type": "object", "properties": {"query": {"type": "string"}}}),
]


def _parse(tok: Tokenizer, family: str, ids: list[int], chunk: int) -> tuple[str, list[ParsedCall]]:
    parser = parser_for(family, tok, TOOLS)
    assert parser is not None
    pieces: list[Piece] = []
    for i in range(0, len(ids), chunk):
        pieces += parser.feed(ids[i : i + chunk])
    pieces += parser.finish()
    text, content = "", []
    for p in pieces:
        if isinstance(p, ContentIds):
            content += p.token_ids
        else:
            text, content = text + tok.decode(content), []
            text += p.text if isinstance(p, RawText) else ""
    text += tok.decode(content)
    return text, [p for p in pieces if isinstance(p, ParsedCall)]


def plain(tok: Tokenizer, ids: list[int]) -> str:
    """What a malformed call shows as text: the model's words, its markers left out."""
    return tok.decode([t for t in ids if t not in tok.special_ids])


def _kimi_call(tok: Tokenizer, call_id: str, args: str) -> list[int]:
    return (
        tok.encode("<|tool_call_begin|>")
        + ordinary_ids(tok, call_id)
        + tok.encode("<|tool_call_argument_begin|>")
        + ordinary_ids(tok, args)
        + tok.encode("<|tool_call_end|>")
    )


def _glm_call(tok: Tokenizer, name: str, pairs: list[tuple[str, str]]) -> list[int]:
    ids = tok.encode("<tool_call>") + ordinary_ids(tok, name + "\n")
    for k, v in pairs:
        ids += (
            tok.encode("<arg_key>")
            + ordinary_ids(tok, k)
            + tok.encode("</arg_key>")
            + ordinary_ids(tok, "\n")
        )
        ids += (
            tok.encode("<arg_value>")
            + ordinary_ids(tok, v)
            + tok.encode("</arg_value>")
            + ordinary_ids(tok, "\n")
        )
    return ids + tok.encode("</tool_call>")


CHUNKS = [1, 2, 5, 10_000]  # 10_000 = the whole output at once (non-streaming)


@pytest.mark.parametrize("chunk", CHUNKS)
def test_kimi_parallel_calls_after_text(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    tok = load(tmp_path_factory, "kimi-tiktoken")
    tricky = '{"city": "<|tool_call_end|> and functions.x:9", "days": 3}'  # the markers' characters, as text
    ids = (
        tok.encode("Checking both.")
        + tok.encode("<|tool_calls_section_begin|>")
        + _kimi_call(tok, "functions.get_weather:0", tricky)
        + _kimi_call(tok, "functions.search:1", '{"query": "café 🙂"}')
        + tok.encode("<|tool_calls_section_end|>")
    )
    text, calls = _parse(tok, "kimi", ids, chunk)
    assert text == "Checking both."
    assert [(c.index, c.id, c.name) for c in calls] == [
        (0, "functions.get_weather:0", "get_weather"),
        (1, "functions.search:1", "search"),
    ]
    assert json.loads(calls[0].arguments) == json.loads(tricky)
    assert json.loads(calls[1].arguments) == {"query": "café 🙂"}


@pytest.mark.parametrize("chunk", CHUNKS)
def test_kimi_malformed_calls_are_text(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    tok = load(tmp_path_factory, "kimi-tiktoken")
    broken_json = _kimi_call(tok, "functions.get_weather:0", '{"city": ')
    unknown = _kimi_call(tok, "functions.launch_missiles:1", "{}")
    good = _kimi_call(tok, "functions.search:2", '{"query": "ok"}')
    unterminated = tok.encode(
        "<|tool_call_begin|>functions.search:3<|tool_call_argument_begin|>"
    ) + ordinary_ids(tok, '{"q')
    ids = tok.encode("<|tool_calls_section_begin|>") + broken_json + unknown + good + unterminated
    text, calls = _parse(tok, "kimi", ids, chunk)
    assert [c.name for c in calls] == ["search"] and calls[0].index == 0
    # the output ends inside the last call: dropped, not shown as half a call
    assert text == plain(tok, broken_json) + plain(tok, unknown)
    assert "launch_missiles" in text and "<|" not in text


@pytest.mark.parametrize("chunk", CHUNKS)
def test_glm_calls_typed_by_schema(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    tok = load(tmp_path_factory, "glm")
    ids = (
        ordinary_ids(tok, "Let me look.\n")
        + _glm_call(
            tok,
            "get_weather",
            [("city", "42"), ("days", "3"), ("units", "null"), ("hourly", "true"), ("spots", '["a", 1]')],
        )
        + ordinary_ids(tok, "\n")
        + _glm_call(tok, "search", [("query", "</arg_value> inside <tool_call> text")])
    )
    text, calls = _parse(tok, "glm", ids, chunk)
    assert text == "Let me look.\n\n"
    assert [c.name for c in calls] == ["get_weather", "search"]
    assert json.loads(calls[0].arguments) == {
        "city": "42",
        "days": 3,
        "units": None,  # a nullable string: `null` is null, as the template writes None
        "hourly": True,
        "spots": ["a", 1],
    }
    assert json.loads(calls[1].arguments) == {"query": "</arg_value> inside <tool_call> text"}
    assert calls[0].id.startswith("call_") and calls[0].id != calls[1].id


@pytest.mark.parametrize("chunk", CHUNKS)
def test_glm_malformed_calls_are_text(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    tok = load(tmp_path_factory, "glm")
    missing_value = (
        tok.encode("<tool_call>")
        + ordinary_ids(tok, "search\n")
        + tok.encode("<arg_key>")
        + ordinary_ids(tok, "query")
        + tok.encode("</arg_key>")
        + tok.encode("</tool_call>")
    )
    unknown = _glm_call(tok, "rm_rf", [("path", "/")])
    junk_between = (
        tok.encode("<tool_call>")
        + ordinary_ids(tok, "search\n")
        + tok.encode("<arg_key>")
        + ordinary_ids(tok, "query")
        + tok.encode("</arg_key>")
        + ordinary_ids(tok, " junk ")
        + tok.encode("<arg_value>")
        + ordinary_ids(tok, "x")
        + tok.encode("</arg_value></tool_call>")
    )
    good = _glm_call(tok, "search", [("query", "fine")])
    unterminated = tok.encode("<tool_call>") + ordinary_ids(tok, "sea")
    ids = missing_value + unknown + junk_between + good + unterminated
    text, calls = _parse(tok, "glm", ids, chunk)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "fine"})]
    assert text == "".join(plain(tok, x) for x in (missing_value, unknown, junk_between))
    assert "<" not in text.replace("</", "")


def test_streaming_never_shows_half_a_call(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Fed one token at a time, a call appears whole, at the token that closes it, never before."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    call = _kimi_call(tok, "functions.get_weather:0", '{"city": "Paris"}')
    parser = parser_for("kimi", tok, TOOLS)
    assert parser is not None
    seen = [parser.feed([t]) for t in tok.encode("<|tool_calls_section_begin|>") + call]
    assert all(not s for s in seen[:-1])
    assert isinstance(seen[-1][0], ParsedCall) and seen[-1][0].name == "get_weather"


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
def test_random_marker_soup_never_crashes_and_chunking_does_not_matter(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str
) -> None:
    """Random mixes of markers, names, JSON and text: no exception, and every chunking gives the same
    pieces; nothing the model wrote is lost (calls aside, all of it comes back as text)."""
    tok = load(tmp_path_factory, layout)
    markers = list(KIMI_MARKERS if family == "kimi" else GLM_MARKERS)
    words = ["functions.search:0", "search", "get_weather", "query", "\n", '{"query": "x"}', "{", "hi ", "42"]
    rng = random.Random(7)
    for _ in range(400):
        ids: list[int] = []
        for _ in range(rng.randint(1, 14)):
            piece = rng.choice(markers + words)
            ids += tok.encode(piece) if piece in markers else ordinary_ids(tok, piece)
        results = []
        for chunk in (1, 3, len(ids)):
            text, calls = _parse(tok, family, ids, chunk)
            results.append((text, [(c.index, c.name, c.arguments) for c in calls]))
        assert results[0] == results[1] == results[2]
        assert not any(m in results[0][0] for m in markers)  # markup never reaches the text
        if not results[0][1]:  # no call: what was written, markers left out (a call cut by the end dropped)
            assert plain(tok, ids).startswith(results[0][0])


@pytest.mark.parametrize("chunk", CHUNKS)
def test_kimi_sections_without_a_good_call_come_back_whole(
    tmp_path_factory: pytest.TempPathFactory, chunk: int
) -> None:
    tok = load(tmp_path_factory, "kimi-tiktoken")
    empty = (
        tok.encode("<|tool_calls_section_begin|>")
        + ordinary_ids(tok, "\n")
        + tok.encode("<|tool_calls_section_end|>")
    )
    bad_only = (
        tok.encode("<|tool_calls_section_begin|>")
        + _kimi_call(tok, "functions.nope:0", "{}")
        + tok.encode("<|tool_calls_section_end|>")
    )
    cut = tok.encode("<|tool_call_begin|>") + ordinary_ids(tok, "functions.sea")  # cut short by the next call
    sectionless = _kimi_call(tok, "functions.search:1", '{"query": "q"}')
    ids = ordinary_ids(tok, "A ") + empty + bad_only + cut + sectionless + ordinary_ids(tok, " after")
    text, calls = _parse(tok, "kimi", ids, chunk)
    assert [(c.index, c.id) for c in calls] == [(0, "functions.search:1")]
    assert text == "A " + plain(tok, empty) + plain(tok, bad_only) + plain(tok, cut) + " after"


@pytest.mark.parametrize("chunk", CHUNKS)
def test_glm_call_cut_short_by_the_next(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    tok = load(tmp_path_factory, "glm")
    cut = tok.encode("<tool_call>") + ordinary_ids(tok, "sea")
    good = _glm_call(tok, "search", [("query", "q")])
    text, calls = _parse(tok, "glm", cut + good, chunk)
    assert text == "sea"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("search", {"query": "q"})]


@pytest.mark.parametrize(("layout", "family"), [("kimi-tiktoken", "kimi"), ("glm", "glm")])
def test_a_call_the_output_ends_inside_is_dropped(
    tmp_path_factory: pytest.TempPathFactory, layout: str, family: str
) -> None:
    """`max_tokens` cut the call: the text before it stays, the call is neither a call nor text."""
    tok = load(tmp_path_factory, layout)
    if family == "kimi":
        whole = tok.encode("<|tool_calls_section_begin|>") + _kimi_call(
            tok, "functions.get_weather:0", '{"city": "Tokyo"}'
        )
    else:
        whole = _glm_call(tok, "get_weather", [("city", "Tokyo")])
    before = ordinary_ids(tok, "Checking. ")
    for cut in range(1, len(whole) - 1):
        for chunk in (1, 1000):
            text, calls = _parse(tok, family, before + whole[:cut], chunk)
            assert (text, calls) == ("Checking. ", []), cut


@pytest.mark.parametrize(
    "parameters",
    [
        {"type": "object", "properties": {"x": True}},  # valid JSON Schema: any value
        {"type": "object", "properties": ["x"]},  # malformed: the call is still parsed, untyped
        {"type": "object", "properties": {"x": "integer"}},
    ],
)
def test_glm_call_with_an_odd_tool_schema_is_parsed_not_a_crash(
    tmp_path_factory: pytest.TempPathFactory, parameters: dict[str, object]
) -> None:
    tok = load(tmp_path_factory, "glm")
    parser = parser_for("glm", tok, [Tool(name="echo", parameters=parameters)])
    assert parser is not None
    pieces = parser.feed(_glm_call(tok, "echo", [("x", "7"), ("y", "seven")])) + parser.finish()
    calls = [p for p in pieces if isinstance(p, ParsedCall)]
    assert [json.loads(c.arguments) for c in calls] == [{"x": 7, "y": "seven"}]

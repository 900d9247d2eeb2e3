"""The serving layer between engine and wire: events from scripted engine outputs, settings, and the
faults a real engine cannot be made to produce on demand (a crash mid-stream, a busy refusal)."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import pytest
from starlette.applications import Starlette

from backend.errors import Busy, ContextWindowExceeded
from backend.server import generation
from backend.server.app import Backend, create_app
from backend.server.app import main as server_main
from backend.server.generation import Serving
from backend.server.metrics import BackendMetrics
from backend.server.model_card import TOOL_MARKERS, ServedModel
from backend.server.settings import build_settings
from backend.text.output_processor import OutputProcessor, StopMatcher
from backend.text.reasoning import ReasoningParser, ThinkMarkers
from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers import MARKERS as TOOL_MARKERS_OF
from backend.text.tool_parsers import parser_for
from schemas.backend import (
    EngineOutput,
    EngineRequest,
    Error,
    ErrorBody,
    Event,
    Finish,
    GenerateRequest,
    LoadReport,
    Message,
    ModelCard,
    ReasoningDelta,
    SamplingParams,
    Started,
    TextDelta,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    TopLogprob,
    Usage,
)
from tests.backend.server_checkpoints import SECRET, TENANT
from tests.backend.server_tokenizers import load, ordinary_ids, tokenizer_dir


def _outputs(chunks: list[list[int]], reason: str = "stop") -> list[EngineOutput]:
    outs = [
        EngineOutput(request_id="r", token_ids=c, num_prompt_tokens=5, num_output_tokens=i + 1)
        for i, c in enumerate(chunks)
    ]
    outs[-1].finish_reason = reason  # type: ignore[assignment]
    return outs


def _processor(
    tok: Tokenizer,
    family: str,
    *,
    stops: list[str] = (),
    tools: list[Tool] | None = None,
    prompt: str = "",
    enabled: bool = True,
) -> OutputProcessor:
    """As `Serving` builds it: with tools, the family's call-opening marker ends a reasoning block."""
    think = ThinkMarkers.of(tok)
    assert think is not None
    parser = parser_for(family, tok, tools) if tools else None
    kept = {think.start_id, think.end_id}
    if parser is not None:
        kept |= {i for i in (tok.token_to_id(m) for m in TOOL_MARKERS) if i is not None}
    call_start = tok.token_to_id(TOOL_MARKERS_OF[family][0]) if parser is not None else None
    return OutputProcessor(
        tok,
        reasoning=ReasoningParser(
            think, prompt_token_ids=tok.encode(prompt), enabled=enabled, call_start_id=call_start
        ),
        tools=parser,
        stops=list(stops),
        skip_ids=tok.special_ids - kept,
    )


def _run(processor: OutputProcessor, outputs: list[EngineOutput]) -> list[Event]:
    events: list[Event] = []
    for out in outputs:
        events += processor.process(out)
        if processor.is_stopped:
            break
    return events


def test_stop_matcher_holds_back_a_possible_stop() -> None:
    matcher = StopMatcher(["world", "xyz"])
    assert matcher.push("Hello wo") == ("Hello ", False)  # "wo" may begin "world": it waits
    assert matcher.push("rld and more") == ("", True)
    assert StopMatcher(["world"]).push("Hello wx") == ("Hello wx", False)
    other = StopMatcher(["##"])
    assert other.push("a#") == ("a", False) and other.push("b") == ("#b", False) and other.flush() == ""


def test_stop_string_split_across_outputs(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    ids = ordinary_ids(tok, "The quick brown fox jumps")
    events = _run(_processor(tok, "glm", stops=["brown f"]), _outputs([[i] for i in ids], "length"))
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The quick "
    assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


def test_reasoning_text_and_tool_call_in_one_answer(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    tools = [Tool(name="search", parameters={"type": "object", "properties": {"q": {"type": "string"}}})]
    ids = (
        tok.encode("<think>")
        + ordinary_ids(tok, "plan 🙂")
        + tok.encode("</think>")
        + ordinary_ids(tok, "Sure.")
        + tok.encode("<tool_call>")
        + ordinary_ids(tok, "search\n")
        + tok.encode("<arg_key>")
        + ordinary_ids(tok, "q")
        + tok.encode("</arg_key><arg_value>")
        + ordinary_ids(tok, "café")
        + tok.encode("</arg_value></tool_call>")
        + tok.encode("<|observation|>")
    )
    events = _run(_processor(tok, "glm", tools=tools), _outputs([[i] for i in ids]))
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "plan 🙂"
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure."
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert [(c.index, c.name, json.loads(c.arguments)) for c in calls] == [(0, "search", {"q": "café"})]
    assert isinstance(events[-2], Usage) and events[-2].prompt_tokens == 5
    assert events[-1] == Finish(reason="tool_calls")


@pytest.mark.parametrize("is_thinking", [True, False])
def test_glm_reasoning_by_default_and_no_leading_newline(
    tmp_path_factory: pytest.TempPathFactory, is_thinking: bool
) -> None:
    """GLM-5's prompt ends in `<think>` (thinking, the default) or `</think>` (off); the model then
    writes `…</think>\nAnswer`. The thoughts are reasoning, the answer starts at its first
    character, streamed token by token or not."""
    tok = load(tmp_path_factory, "glm")
    thoughts = ordinary_ids(tok, "Add 3 and 4.") + tok.encode("</think>") if is_thinking else []
    ids = thoughts + ordinary_ids(tok, "\n\nThe answer is 7.\nDone.")
    prompt = "<|assistant|><think>" if is_thinking else "<|assistant|></think>"
    for chunks in ([[i] for i in ids], [ids]):
        events = _run(_processor(tok, "glm", prompt=prompt), _outputs(chunks))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert reasoning == ("Add 3 and 4." if is_thinking else "")
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The answer is 7.\nDone."


def test_stray_special_tokens_are_not_text_and_logprobs_carry_text(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tok = load(tmp_path_factory, "kimi-tiktoken")
    hello = ordinary_ids(tok, "Hi")
    out = EngineOutput(
        request_id="r",
        token_ids=hello + tok.encode("<|im_end|>"),
        finish_reason="stop",
        logprobs=[TokenLogprob(token="", token_id=hello[0], logprob=-0.5)],
    )
    events = _processor(tok, "kimi").process(out)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Hi"
    logprobs = next(e.logprobs for e in events if isinstance(e, TextDelta) and e.logprobs)
    assert logprobs[0].token == tok.decode(hello[:1])


def _with_logprobs(outputs: list[EngineOutput]) -> list[EngineOutput]:
    """Each output's ids with a logprob each (a top logprob too), as the engine sends them."""
    for out in outputs:
        out.logprobs = [
            TokenLogprob(
                token="", token_id=i, logprob=-0.5, top=[TopLogprob(token="", token_id=i, logprob=-0.5)]
            )
            for i in out.token_ids
        ]
    return outputs


def _answer_logprobs(events: list[Event]) -> list[TokenLogprob]:
    return [lp for e in events if isinstance(e, TextDelta) and e.logprobs for lp in e.logprobs]


@pytest.mark.parametrize("layout", ["glm", "kimi-tiktoken"])
@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_logprobs_are_the_answers_tokens_and_join_into_its_text(
    tmp_path_factory: pytest.TempPathFactory, layout: str, chunk: int
) -> None:
    """OpenAI's `logprobs.content`: one entry per token of the answer, each with its own bytes, so that
    joined they give the content, characters split over tokens included (those tokens' text alone is
    U+FFFD); the reasoning, the think markers and the end-of-turn token have none (they had, reading
    apart from `content`: sglang#25055)."""
    tok = load(tmp_path_factory, layout)
    thoughts, answer = ordinary_ids(tok, "plan 🌍"), ordinary_ids(tok, "Sure, 日本語 €.")
    assert any("\ufffd" in tok.decode([i]) for i in answer)
    end = tok.encode("<|user|>" if layout == "glm" else "<|im_end|>")
    ids = tok.encode("<think>") + thoughts + tok.encode("</think>") + answer + end
    outputs = _with_logprobs(_outputs([ids[i : i + chunk] for i in range(0, len(ids), chunk)]))
    events = _run(_processor(tok, layout.split("-")[0]), outputs)
    logprobs = _answer_logprobs(events)
    assert [lp.token_id for lp in logprobs] == answer
    assert b"".join(lp.token_bytes or b"" for lp in logprobs) == "Sure, 日本語 €.".encode()
    assert [t.token_bytes for lp in logprobs for t in lp.top] == [lp.token_bytes for lp in logprobs]
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Sure, 日本語 €."


@pytest.mark.parametrize("chunk", [1, 4, 1000])
def test_a_tool_calls_tokens_have_no_logprobs_and_a_malformed_ones_have(
    tmp_path_factory: pytest.TempPathFactory, chunk: int
) -> None:
    """The text around a parsed call keeps its tokens' logprobs, the call's own tokens (markers,
    name, arguments) have none; a call naming no offered tool comes back as text, its tokens'
    logprobs with it (markers left out, as from the text)."""
    tok = load(tmp_path_factory, "glm")
    tools = [Tool(name="search", parameters={"type": "object", "properties": {"q": {"type": "string"}}})]

    def call(name: str) -> list[int]:
        return (
            tok.encode("<tool_call>")
            + ordinary_ids(tok, f"{name}\n")
            + tok.encode("<arg_key>")
            + ordinary_ids(tok, "q")
            + tok.encode("</arg_key><arg_value>")
            + ordinary_ids(tok, "café")
            + tok.encode("</arg_value></tool_call>")
        )

    before, between = ordinary_ids(tok, "Sure."), ordinary_ids(tok, " Then")
    ids = before + call("search") + between + call("nosuch") + tok.encode("<|observation|>")
    outputs = _with_logprobs(_outputs([ids[i : i + chunk] for i in range(0, len(ids), chunk)]))
    events = _run(_processor(tok, "glm", tools=tools), outputs)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert [(c.name, json.loads(c.arguments)) for c in events if isinstance(c, ToolCallDelta)] == [
        ("search", {"q": "café"})
    ]
    bad = [i for i in call("nosuch") if i not in tok.special_ids]
    assert [lp.token_id for lp in _answer_logprobs(events)] == before + between + bad
    assert b"".join(lp.token_bytes or b"" for lp in _answer_logprobs(events)) == text.encode()


def _kimi_call(tok: Tokenizer, name: str, arguments: str, index: int) -> list[int]:
    return (
        tok.encode("<|tool_call_begin|>")
        + ordinary_ids(tok, f"functions.{name}:{index}")
        + tok.encode("<|tool_call_argument_begin|>")
        + ordinary_ids(tok, arguments)
        + tok.encode("<|tool_call_end|>")
    )


KIMI_SECTIONS = {  # (what the model writes, between the marker lists) -> the answer text
    "a bad call held, then a good one": (
        lambda tok: (
            ordinary_ids(tok, "Hi.")
            + tok.encode("<|tool_calls_section_begin|>")
            + _kimi_call(tok, "nosuch", '{"a": 1}', 0)
            + _kimi_call(tok, "f", '{"a": 2}', 1)
            + tok.encode("<|tool_calls_section_end|>")
        ),
        'Hi.functions.nosuch:0{"a": 1}',
    ),
    "layout between a good call and a bad one": (
        lambda tok: (
            ordinary_ids(tok, "Hi.")
            + tok.encode("<|tool_calls_section_begin|>")
            + _kimi_call(tok, "f", '{"a": 2}', 0)
            + ordinary_ids(tok, "\n  ")
            + _kimi_call(tok, "nosuch", '{"a": 1}', 1)
            + tok.encode("<|tool_calls_section_end|>")
        ),
        'Hi.functions.nosuch:1{"a": 1}',
    ),
    "layout of a closed section, then a bare bad call": (
        lambda tok: (
            tok.encode("<|tool_calls_section_begin|>")
            + _kimi_call(tok, "f", '{"a": 2}', 0)
            + ordinary_ids(tok, "\nLAYOUT\n")
            + tok.encode("<|tool_calls_section_end|>")
            + ordinary_ids(tok, " ok ")
            + _kimi_call(tok, "nosuch", '{"a": 1}', 1)
        ),
        ' ok functions.nosuch:1{"a": 1}',
    ),
    "a section open at the end": (
        lambda tok: (
            ordinary_ids(tok, "Hi.")
            + tok.encode("<|tool_calls_section_begin|>")
            + ordinary_ids(tok, " no call")
        ),
        "Hi. no call",
    ),
}


@pytest.mark.parametrize("case", sorted(KIMI_SECTIONS))
@pytest.mark.parametrize("chunk", [1, 1000])
def test_kimi_sections_logprobs_join_into_the_text(
    tmp_path_factory: pytest.TempPathFactory, case: str, chunk: int
) -> None:
    """Kimi's calls come in sections: a bad call held until a good one commits the section comes
    back as text with its tokens' logprobs; layout between calls and after them has none. (A review
    found each of these out of line with the text.) An empty last output, as an abort sends, too."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    tools = [Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]
    write, text = KIMI_SECTIONS[case]
    ids = write(tok)
    for tail in ([], [[]]):
        chunks = [ids[i : i + chunk] for i in range(0, len(ids), chunk)] + tail
        events = _run(_processor(tok, "kimi", tools=tools), _with_logprobs(_outputs(chunks)))
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == text
        assert b"".join(lp.token_bytes or b"" for lp in _answer_logprobs(events)) == text.encode()


CALL_TEXT_FIRST = {  # (family, what the model writes): a malformed call back as text opens the answer
    "glm: a call's newline then text": ("glm", ["<tool_call>", "\n", "x", "</tool_call>"]),
    "glm: a call's text, then a newline": ("glm", ["<tool_call>", "x", "</tool_call>", "\n", "y"]),
    "kimi: a section of layout alone": (
        "kimi",
        ["<|tool_calls_section_begin|>", "\n", "<|tool_calls_section_end|>", "y"],
    ),
    "kimi: a bare call's text, then a newline": (
        "kimi",
        ["<|tool_call_begin|>", "x", "<|tool_call_end|>", "\n", "y"],
    ),
    "kimi: a section open at the end": ("kimi", ["<|tool_calls_section_begin|>", "\n", "x"]),
}


@pytest.mark.parametrize("case", sorted(CALL_TEXT_FIRST))
@pytest.mark.parametrize("chunk", [1, 1000])
def test_newlines_around_a_call_back_as_text_follow_the_text(
    tmp_path_factory: pytest.TempPathFactory, case: str, chunk: int
) -> None:
    """The newlines dropped before the answer's first character are dropped from its logprobs
    whichever way they come, a malformed call's text included, and kept once the answer began
    (a second review's cases)."""
    family, pieces = CALL_TEXT_FIRST[case]
    tok = load(tmp_path_factory, "glm" if family == "glm" else "kimi-tiktoken")
    tools = [Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "integer"}}})]
    ids = [
        i
        for piece in pieces
        for i in (tok.encode(piece) if piece.startswith("<") else ordinary_ids(tok, piece))
    ]
    outputs = _with_logprobs(_outputs([ids[i : i + chunk] for i in range(0, len(ids), chunk)], "length"))
    events = _run(_processor(tok, family, tools=tools), outputs)
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    assert text and not text.startswith("\n")
    assert b"".join(lp.token_bytes or b"" for lp in _answer_logprobs(events)) == text.encode()


@pytest.mark.parametrize("chunk", [1, 1000])
def test_the_newlines_before_glms_answer_have_no_logprobs(
    tmp_path_factory: pytest.TempPathFactory, chunk: int
) -> None:
    tok = load(tmp_path_factory, "glm")
    ids = ordinary_ids(tok, "think") + tok.encode("</think>") + ordinary_ids(tok, "\n\nAnswer.\n")
    outputs = _with_logprobs(_outputs([ids[i : i + chunk] for i in range(0, len(ids), chunk)]))
    events = _run(_processor(tok, "glm", prompt="<|assistant|><think>"), outputs)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Answer.\n"
    assert b"".join(lp.token_bytes or b"" for lp in _answer_logprobs(events)) == b"Answer.\n"


@pytest.mark.parametrize("chunk", [1, 2, 1000])
def test_no_logprobs_past_a_stop_string(tmp_path_factory: pytest.TempPathFactory, chunk: int) -> None:
    """A token's logprob goes with its text: while the text may be the start of a stop string it
    waits, and past the stop string (the output that stopped included) none goes; a token the stop
    string cuts (" brown": its space is text, "brown" the stop's) has none either."""
    tok = load(tmp_path_factory, "glm")
    ids = ordinary_ids(tok, "The quick brown fox jumps over")
    outputs = _with_logprobs(_outputs([ids[i : i + chunk] for i in range(0, len(ids), chunk)], "length"))
    events = _run(_processor(tok, "glm", stops=["brown f"]), outputs)
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "The quick "
    assert b"".join(lp.token_bytes or b"" for lp in _answer_logprobs(events)) == b"The quick"


def test_engine_error_becomes_an_error_event(tmp_path_factory: pytest.TempPathFactory) -> None:
    tok = load(tmp_path_factory, "glm")
    out = EngineOutput(
        request_id="r",
        finish_reason="abort",
        num_prompt_tokens=5,
        error=Error(code="integrity_abort", message="tag mismatch", status=500),
    )
    events = _processor(tok, "glm").process(out)
    assert isinstance(events[-2], Usage) and events[-1] == Error(
        code="integrity_abort", message="tag mismatch", status=500
    )


def test_settings(tmp_path: Path) -> None:
    env = {"KUMO_BACKEND_SECRET": "from-the-environment"}
    settings = build_settings(["--model", str(tmp_path), "--port", "9000", "--kv-dtype", "fp8"], env)
    assert (settings.secret, settings.host, settings.engine_kv_dtype) == (
        "from-the-environment",
        "127.0.0.1",
        "float8_e4m3fn",
    )
    assert (
        build_settings(["--model", "m", "--port", "1", "--secret", "from-the-flag-0"], env).secret
        == "from-the-flag-0"
    )
    flags = ["--model", "m", "--port", "1", "--secret", "long-enough"]
    assert build_settings(flags, {}).speculative_graphs  # on by default, eager only when asked
    assert not build_settings(
        [*flags, "--speculative", "mtp:2", "--no-speculative-graphs"], {}
    ).speculative_graphs
    assert build_settings(flags, {}).pdl and not build_settings([*flags, "--no-pdl"], {}).pdl
    for argv in (
        ["--model", "m", "--port", "1"],
        ["--model", "m", "--port", "99999", "--secret", "long-enough"],
    ):
        with pytest.raises(SystemExit):
            build_settings(argv, {})


class ScriptedEngine:
    """Stands in for the engine where a real one cannot be made to fail on demand."""

    def __init__(self, tok: Tokenizer) -> None:
        self.tok, self.num_closed = tok, 0

    async def generate(self, request: EngineRequest, **_: object) -> AsyncIterator[EngineOutput]:
        prompt = self.tok.decode(request.prompt_token_ids)
        if "busy" in prompt:
            raise Busy("no room this step")
        try:
            if "hang" in prompt:  # a prefill that takes longer than the client waits
                await asyncio.Event().wait()
            yield EngineOutput(request_id=request.request_id, token_ids=ordinary_ids(self.tok, "partial"))
            if "crash" in prompt:
                raise RuntimeError("boom")
            yield EngineOutput(
                request_id=request.request_id,
                token_ids=ordinary_ids(self.tok, " ok"),
                finish_reason="stop",
                num_output_tokens=2,
            )
        finally:
            self.num_closed += 1

    def abort(self, request_id: str) -> None:
        raise AssertionError("serving aborts by closing the stream")

    def load(self) -> LoadReport:
        return LoadReport(waiting=0, running=0, free_pages=1, total_pages=1)


@pytest.fixture
def scripted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Starlette, ScriptedEngine]:
    folder = tmp_path_factory.mktemp(
        "scripted"
    )  # a checkpoint folder of its own: tokenizer + config, no weights
    shutil.copytree(tokenizer_dir(tmp_path_factory, "glm"), folder, dirs_exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"], **_GLM_CONFIG}))
    served = ServedModel.from_checkpoint(folder)
    engine = ScriptedEngine(served.tokenizer)
    card = ModelCard(
        name="m",
        architecture="Glm4MoeForCausalLM",
        family="glm",
        weights="float32",
        kv_dtype="float32",
        context_window=1024,
        page_size=16,
        num_pages=1,
    )
    backend = Backend(
        serving=Serving(served, engine),
        card=card,
        secret=SECRET,
        metrics=BackendMetrics(lambda: _NO_STATS, engine.load),
    )  # type: ignore[arg-type]
    return create_app(backend), engine


async def test_faults_stay_with_their_request(scripted: tuple[Starlette, ScriptedEngine]) -> None:
    app, _ = scripted
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
        headers = {"authorization": f"Bearer {SECRET}"}

        async def send(text: str) -> httpx.Response:
            return await client.post(
                "/v1/generate",
                headers=headers,
                json={
                    "request_id": text,
                    "tenant_salt": TENANT,
                    "messages": [{"role": "user", "content": text}],
                    "reasoning": {"enabled": False},
                },
            )

        busy = await send("busy")
        assert (
            busy.status_code == 429 and msgspec.json.decode(busy.content, type=ErrorBody).error.code == "busy"
        )
        crash = await send("crash")
        events = [msgspec.json.decode(line, type=Event) for line in crash.text.splitlines()]
        assert isinstance(events[0], Started)  # (the scripted engine counts no prompt)
        assert events[1] == TextDelta(text="partial")
        assert isinstance(events[-1], Error) and events[-1].code == "internal"
        fine = await send("fine")
        assert (
            "".join(
                e.text
                for e in (msgspec.json.decode(x, type=Event) for x in fine.text.splitlines())
                if isinstance(e, TextDelta)
            )
            == "partial ok"
        )


async def test_client_gone_during_prefill_aborts(scripted: tuple[Starlette, ScriptedEngine]) -> None:
    """The client leaves before the first token: the engine stream is closed (the request aborted) then,
    not when that token would have been sent."""
    app, engine = scripted
    payload = json.dumps(
        {
            "request_id": "h",
            "tenant_salt": TENANT,
            "reasoning": {"enabled": False},
            "messages": [{"role": "user", "content": "hang"}],
        }
    ).encode()
    inbox: list[dict[str, object]] = [{"type": "http.request", "body": payload, "more_body": False}]
    sent: list[dict[str, object]] = []

    async def receive() -> dict[str, object]:
        if inbox:
            return inbox.pop(0)
        await asyncio.sleep(0.2)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, object]) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/generate",
        "raw_path": b"/v1/generate",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"authorization", f"Bearer {SECRET}".encode()), (b"content-type", b"application/json")],
        "server": ("backend", 80),
        "client": ("gateway", 1),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=5)
    assert engine.num_closed == 1
    assert sent[0]["status"] == 499


class _Stats:
    steps = generated_tokens = tag_check_aborts = aborts = preemptions = prefix_hits = prefix_misses = 0
    cached_tokens = spec_verifies = spec_drafted_tokens = spec_accepted_tokens = 0
    spec_draft_length = 0
    spec_acceptance_length = 0.0
    total_step_s = last_step_s = 0.0


_NO_STATS = _Stats()
_GLM_CONFIG = {
    "model_type": "glm4_moe",
    "vocab_size": 1024,
    "hidden_size": 64,
    "intermediate_size": 96,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 1024,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
}


def test_unservable_checkpoint_exits_with_the_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # (its port bound first, then closed again: a leaked socket would fail this test)
    assert server_main(["--model", str(tmp_path / "nope"), "--port", "0", "--secret", SECRET]) == 1
    assert "config.json" in capsys.readouterr().err


def test_events_do_not_depend_on_how_tokens_are_batched(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Whatever the engine's step sizes, the same answer, reasoning, calls and finish come out."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    tools = [Tool(name="search", parameters={"type": "object", "properties": {"q": {"type": "string"}}})]
    pieces = [
        "<think>",
        "</think>",
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.search:0",
        "<|tool_call_argument_begin|>",
        '{"q": "é"}',
        "<|tool_call_end|>",
        "<|tool_calls_section_end|>",
        "Hi 🙂 ",
        "STOP",
        "你好",
        "<|im_end|>",
    ]
    rng = random.Random(3)
    for _ in range(60):
        ids: list[int] = []
        for _ in range(rng.randint(1, 12)):
            piece = rng.choice(pieces)
            ids += tok.encode(piece) if piece.startswith("<") else ordinary_ids(tok, piece)
        summaries = []
        for chunk in (1, 2, len(ids)):
            events = _run(
                _processor(tok, "kimi", stops=["STOP"], tools=tools),
                _outputs([ids[i : i + chunk] for i in range(0, len(ids), chunk)]),
            )
            summaries.append(
                (
                    "".join(e.text for e in events if isinstance(e, TextDelta)),
                    "".join(e.text for e in events if isinstance(e, ReasoningDelta)),
                    [(e.index, e.name, e.arguments) for e in events if isinstance(e, ToolCallDelta)],
                    events[-1],
                )
            )
        assert summaries[0] == summaries[1] == summaries[2]
        assert "STOP" not in summaries[0][0]


def test_prompt_logprobs_reach_usage_when_the_answer_has_many_tokens(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """The engine hands prompt log-probs over with the first token only; usage comes with the last."""
    tok = load(tmp_path_factory, "glm")
    ids = ordinary_ids(tok, "The quick brown")
    scored = [None, TokenLogprob(token="", token_id=ids[0], logprob=-1.5)]
    outputs = _outputs([[i] for i in ids], "length")
    outputs[0].prompt_logprobs = scored
    events = _run(_processor(tok, "glm"), outputs)
    usage = next(e for e in events if isinstance(e, Usage))
    named = TokenLogprob(token=tok.decode(ids[:1]), token_id=ids[0], logprob=-1.5, token_bytes=b"The")
    assert usage.prompt_logprobs == [None, named]


KIMI_WEATHER = Tool(
    name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}
)


def _kimi_section(tok: Tokenizer) -> list[int]:
    return (
        tok.encode("<|tool_calls_section_begin|><|tool_call_begin|>")
        + ordinary_ids(tok, "functions.get_weather:0")
        + tok.encode("<|tool_call_argument_begin|>")
        + ordinary_ids(tok, '{"city": "Paris"}')
        + tok.encode("<|tool_call_end|><|tool_calls_section_end|>")
    )


@pytest.mark.parametrize("enabled", [True, False])
def test_a_tool_call_made_inside_the_reasoning_block_is_a_call(
    tmp_path_factory: pytest.TempPathFactory, enabled: bool
) -> None:
    """Kimi K2.5's prompt ends in `<think>`, and Kimi K2 Thinking calls tools from inside its reasoning.
    The call's opening marker ends the block: the call is parsed and the turn ends "tool_calls", with
    no markup in the reasoning or the answer (it was all reasoning text and "stop"; with reasoning off,
    dropped), streamed token by token or not."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    ids = ordinary_ids(tok, "I will call it. ") + _kimi_section(tok)
    prompt = "<|im_assistant|>assistant<|im_middle|><think>"
    for chunks in ([[i] for i in ids], [ids]):
        processor = _processor(tok, "kimi", tools=[KIMI_WEATHER], prompt=prompt, enabled=enabled)
        events = _run(processor, _outputs(chunks))
        reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
        assert reasoning == ("I will call it. " if enabled else "")
        assert "".join(e.text for e in events if isinstance(e, TextDelta)) == ""
        calls = [e for e in events if isinstance(e, ToolCallDelta)]
        assert [(c.id, c.name, json.loads(c.arguments)) for c in calls] == [
            ("functions.get_weather:0", "get_weather", {"city": "Paris"})
        ]
        assert events[-1] == Finish(reason="tool_calls")
        usage = events[-2]  # the reasoning's tokens counted, shown or not
        assert isinstance(usage, Usage) and usage.reasoning_tokens == len(
            ordinary_ids(tok, "I will call it. ")
        )


def test_text_held_for_a_stop_string_goes_out_before_the_call(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`stop: ["\n\n"]` holds back a trailing newline (it may begin the stop string); a call comes
    next, and no stop string spans a call: the held text is sent before the call, not after it."""
    tok = load(tmp_path_factory, "kimi-tiktoken")
    ids = ordinary_ids(tok, "Let me check.\n") + _kimi_section(tok)
    events = _run(_processor(tok, "kimi", stops=["\n\n"], tools=[KIMI_WEATHER]), _outputs([[i] for i in ids]))
    kinds = [
        type(e).__name__
        for e in events
        if isinstance(e, TextDelta | ToolCallDelta) and not (isinstance(e, TextDelta) and not e.text)
    ]
    assert kinds[-1] == "ToolCallDelta" and "ToolCallDelta" not in kinds[:-1], kinds
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "Let me check.\n"


async def test_the_first_output_always_makes_an_event(scripted: tuple[Starlette, ScriptedEngine]) -> None:
    """The first engine output's text is held back (it may begin a stop string): an empty text event
    still goes out with it, saying the prompt is in (the gateway routes a request's other choices on
    it, to start from its cached prompt pages); the text follows as before."""
    app, _ = scripted
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://b") as client:
        r = await client.post(
            "/v1/generate",
            headers={"authorization": f"Bearer {SECRET}"},
            json={
                "request_id": "held",
                "tenant_salt": TENANT,
                "messages": [{"role": "user", "content": "held"}],
                "reasoning": {"enabled": False},
                "sampling": {"stop": ["partial!"]},
            },
        )
    events = [msgspec.json.decode(line, type=Event) for line in r.text.splitlines()]
    assert isinstance(events[0], Started) and events[1] == TextDelta(text="")
    assert "".join(e.text for e in events if isinstance(e, TextDelta)) == "partial ok"
    assert isinstance(events[-1], Finish)


async def test_health_says_failed_once_the_engine_thread_died(
    scripted: tuple[Starlette, ScriptedEngine],
) -> None:
    """A backend whose engine can no longer step answers `failed` (the gateway ejects it) instead of
    ok while every request it takes waits forever."""
    app, engine = scripted
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://b") as client:
        assert (await client.get("/v1/health")).json() == {"status": "ok"}
        engine.is_alive = False  # type: ignore[attr-defined]
        assert (await client.get("/v1/health")).json() == {"status": "failed"}


def test_a_prompt_over_the_window_by_its_length_is_refused_untokenized(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token stands for `max_token_bytes` characters at most, so a text longer than the window
    times that is refused before it is tokenized (a 9 MB prompt took 7-32 s to refuse after). The
    bound never refuses what fits: a raw prompt's specials are read whole, many characters a token."""
    folder = tmp_path_factory.mktemp("window")
    shutil.copytree(tokenizer_dir(tmp_path_factory, "glm"), folder, dirs_exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"], **_GLM_CONFIG}))
    served = ServedModel.from_checkpoint(folder)
    serving = Serving(served, ScriptedEngine(served.tokenizer), max_request_tokens=512)
    tok = served.tokenizer
    sampling = SamplingParams(max_tokens=16)

    def chat(text: str) -> GenerateRequest:
        return GenerateRequest(
            request_id="w",
            tenant_salt="a" * 32,
            sampling=sampling,
            messages=[Message(role="user", content=text)],
        )

    # a short text is counted: its refusal names its tokens, the same as one just over by them
    with pytest.raises(ContextWindowExceeded) as info:
        serving.prepare(msgspec.structs.replace(chat("Hello"), sampling=SamplingParams(max_tokens=600)))
    counted = info.value.num_requested - 600
    assert counted == len(serving.prepare(chat("Hello")).engine_request.prompt_token_ids) > 1
    monkeypatch.setattr(generation, "EXACT_REFUSAL_CHARS", 0)  # the bound alone, from here on
    tokenized = tok.encode_many
    monkeypatch.setattr(tok, "encode_many", lambda texts: pytest.fail("tokenized"))
    with pytest.raises(ContextWindowExceeded) as info:
        serving.prepare(chat("x" * (512 - 16) * tok.max_token_bytes + "x"))
    assert info.value.context_window == 512 and info.value.num_requested == 512 + 1
    monkeypatch.setattr(tok, "encode_many", tokenized)
    with pytest.raises(ContextWindowExceeded) as info:  # under the bound, over by its tokens
        serving.prepare(chat("word " * 600))
    assert info.value.num_requested >= 600 + 16  # counted: the bound says 3,000 / max_token_bytes
    # a vocabulary whose ordinary tokens are shorter than its specials' spellings (the cached value)
    monkeypatch.setitem(tok.__dict__, "max_token_bytes", 4)
    serving = Serving(served, ScriptedEngine(tok), max_request_tokens=512)
    longest = max(tok.special_spellings, key=len)
    count = 512 - 16 - 8
    with pytest.raises(ContextWindowExceeded):  # as chat text, `count` spellings are over the bound
        serving.prepare(chat(longest * count))
    raw = GenerateRequest(
        request_id="r", tenant_salt="a" * 32, sampling=sampling, prompt=longest * count, raw=True
    )
    assert len(serving.prepare(raw).engine_request.prompt_token_ids) == count  # fits: admitted

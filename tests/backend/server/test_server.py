"""The backend HTTP server end to end: one real `kumo backend` process on a tiny GLM-5 checkpoint."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from backend.text.tokenizer import load_tokenizer
from schemas.backend import (
    ErrorBody,
    Event,
    Finish,
    LoadReport,
    ModelCard,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from tests.backend.server_checkpoints import SECRET, TENANT
from tests.backend.server_process import RunningBackend, run_backend

AUTH = {"authorization": f"Bearer {SECRET}"}
_event = msgspec.json.Decoder(Event).decode
PROMPTS = [
    "Weather in Paris?",
    "Tell me a story about a fox.",
    "What is 12 * 7?",
    "def add(a, b):",
    "你好，世界",
    "Numbers: 1 2 3",
    "Hello there, how are you today?",
    "Emoji 🙂 please",
]


@pytest.fixture(scope="session")
def backend_process(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningBackend]:
    yield from run_backend(tmp_path_factory)


@pytest.fixture
async def client(backend_process: RunningBackend) -> AsyncIterator[httpx.AsyncClient]:
    limits = httpx.Limits(max_connections=100, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=backend_process.url, timeout=60, limits=limits) as c:
        yield c


def body(request_id: str, content: str = "Hello", **extra: Any) -> dict[str, Any]:
    sampling = {"max_tokens": 12, "temperature": 0.0} | extra.pop("sampling", {})
    return {
        "request_id": request_id,
        "tenant_salt": TENANT,
        "messages": [{"role": "user", "content": content}],
        "sampling": sampling,
    } | extra


async def generate(client: httpx.AsyncClient, payload: dict[str, Any]) -> list[Event]:
    response = await client.post("/v1/generate", json=payload, headers=AUTH)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"] == "application/x-ndjson"
    return [_event(line) for line in response.text.splitlines()]


def text_of(events: list[Event], kind: type = TextDelta) -> str:
    return "".join(e.text for e in events if isinstance(e, kind))


async def scrape(client: httpx.AsyncClient) -> dict[str, float]:
    text = (await client.get("/metrics", headers=AUTH)).text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if not s.labels
    }


async def wait_idle(client: httpx.AsyncClient, total_pages: int) -> LoadReport:
    for _ in range(200):
        load = msgspec.json.decode((await client.get("/v1/load", headers=AUTH)).content, type=LoadReport)
        if load.running == 0 and load.waiting == 0 and load.free_pages == total_pages:
            return load
        await asyncio.sleep(0.05)
    return load


async def test_text_stream_ends_with_usage_and_finish(client: httpx.AsyncClient) -> None:
    events = await generate(client, body("text-1", reasoning={"enabled": False}))
    assert isinstance(events[-1], Finish) and events[-1].reason in ("length", "stop")
    usage = events[-2]
    assert isinstance(usage, Usage) and usage.prompt_tokens > 0 and 1 <= usage.completion_tokens <= 12
    assert not any(isinstance(e, ReasoningDelta) for e in events)
    assert text_of(events)
    # greedy is deterministic, and the second run of a prompt longer than a page hits the prefix cache
    again = await generate(client, body("text-2", reasoning={"enabled": False}))
    assert text_of(again) == text_of(events)


async def test_reasoning_on_and_off(client: httpx.AsyncClient) -> None:
    """GLM-5's template opens `<think>` when reasoning is on: output is reasoning until `</think>`."""
    on = await generate(client, body("think-on", "What is 12 * 7?", reasoning={"enabled": True}))
    off = await generate(client, body("think-off", "What is 12 * 7?", reasoning={"enabled": False}))
    assert text_of(on, ReasoningDelta)
    assert not any(isinstance(e, ReasoningDelta) for e in off) and text_of(off)
    default = await generate(client, body("think-default", "What is 12 * 7?"))
    assert text_of(default, ReasoningDelta) == text_of(on, ReasoningDelta)


async def test_json_schema_on_random_weights_validates(client: httpx.AsyncClient) -> None:
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "age": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    for i, temperature in enumerate([0.0, 1.0, 1.0]):
        events = await generate(
            client,
            body(
                f"json-{i}",
                response_format={"type": "json_schema", "json_schema": schema},
                sampling={"max_tokens": 60, "temperature": temperature, "seed": i},
            ),
        )
        value = json.loads(text_of(events))
        assert set(value) == {"name", "age"} and len(value["name"]) <= 5 and 0 <= value["age"] <= 99
        assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


async def test_logprob_bytes_rebuild_characters_split_over_tokens(client: httpx.AsyncClient) -> None:
    """A reply (forced by a schema on random weights) whose characters the tokenizer splits over
    tokens: each such token's text alone is U+FFFD, but the logprobs' bytes, joined, are the reply's."""
    reply = "日本語 €"
    events = await generate(
        client,
        body(
            "lp-bytes",
            reasoning={"enabled": False},
            response_format={"type": "json_schema", "json_schema": {"type": "string", "enum": [reply]}},
            sampling={"max_tokens": 40, "logprobs": True, "top_logprobs": 2},
        ),
    )
    text = text_of(events)
    assert json.loads(text) == reply
    logprobs = [lp for e in events if isinstance(e, TextDelta) and e.logprobs for lp in e.logprobs]
    assert sum(lp.token == "\ufffd" for lp in logprobs) >= 2
    assert b"".join(lp.token_bytes or b"" for lp in logprobs) == text.encode()


async def test_forced_tool_call(client: httpx.AsyncClient) -> None:
    tool = {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "days": {"type": "integer", "minimum": 1, "maximum": 5},
            },
            "required": ["city", "days"],
        },
    }
    events = await generate(
        client,
        body(
            "tool-1",
            "Weather?",
            tools=[tool],
            tool_choice={"mode": "function", "name": "get_weather"},
            sampling={"max_tokens": 60, "temperature": 1.0, "seed": 3},
        ),
    )
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id
    assert 1 <= json.loads(calls[0].arguments)["days"] <= 5
    assert isinstance(events[-1], Finish) and events[-1].reason == "tool_calls"


async def test_stop_string_cuts_the_answer(client: httpx.AsyncClient) -> None:
    free = text_of(
        await generate(
            client,
            body(
                "stop-ref",
                "Tell me a story about a fox.",
                reasoning={"enabled": False},
                sampling={"max_tokens": 16},
            ),
        )
    )
    stop = free[len(free) // 2 : len(free) // 2 + 2]
    assert stop.strip()
    events = await generate(
        client,
        body(
            "stop-1",
            "Tell me a story about a fox.",
            reasoning={"enabled": False},
            sampling={"max_tokens": 16, "stop": [stop]},
        ),
    )
    assert text_of(events) == free[: free.index(stop)]
    assert isinstance(events[-1], Finish) and events[-1].reason == "stop"


async def test_disconnects_free_everything_and_others_are_unchanged(
    client: httpx.AsyncClient, backend_process: RunningBackend
) -> None:
    def payload(i: int, max_tokens: int = 16) -> dict[str, Any]:
        return body(
            f"conc-{i}",
            PROMPTS[i % len(PROMPTS)] * 3,
            reasoning={"enabled": False},
            sampling={"max_tokens": max_tokens},
        )

    alone = {i: text_of(await generate(client, payload(i))) for i in range(len(PROMPTS))}
    await wait_idle(client, backend_process.num_pages)

    async def run(i: int) -> str | None:
        leaves = i % 3 == 0  # a third of the clients leave after the first event, long before their end
        request = payload(100 + i, max_tokens=200 if leaves else 16)
        async with client.stream("POST", "/v1/generate", json=request, headers=AUTH) as response:
            assert response.status_code == 200
            lines = response.aiter_lines()
            if leaves:
                await anext(lines)
                return None
            return text_of([_event(line) async for line in lines])

    results = await asyncio.gather(*(run(i) for i in range(50)))
    for i, text in enumerate(results):
        if text is not None:
            assert text == alone[(100 + i) % len(PROMPTS)], i
    load = await wait_idle(client, backend_process.num_pages)
    assert (load.running, load.waiting, load.free_pages) == (0, 0, backend_process.num_pages)
    metrics = await scrape(client)
    assert metrics["kumo_backend_disconnects_total"] >= 17
    assert metrics["kumo_backend_engine_aborts_total"] >= 17
    assert metrics["kumo_backend_pages_used"] == 0


@pytest.mark.parametrize(
    ("raw", "path"),
    [
        (b"{not json", "malformed"),
        (json.dumps(body("bad-1", bogus=1)).encode(), "`bogus`"),
        (json.dumps(body("bad-2", sampling={"temperature": "hot"})).encode(), "$.sampling.temperature"),
        (
            json.dumps(body("bad-3") | {"messages": [{"role": "user", "content": 5}]}).encode(),
            "$.messages[0].content",
        ),
        (json.dumps(body("bad-4", sampling={"max_tokens": 0})).encode(), "$.sampling.max_tokens"),
    ],
)
async def test_bad_bodies_are_400_naming_the_path(client: httpx.AsyncClient, raw: bytes, path: str) -> None:
    response = await client.post("/v1/generate", content=raw, headers=AUTH)
    assert response.status_code == 400
    error = msgspec.json.decode(response.content, type=ErrorBody).error
    assert error.code == "invalid_request"
    assert path in (error.message.lower() if path == "malformed" else error.message)


async def test_refusals_are_structured(client: httpx.AsyncClient) -> None:
    too_long = await client.post(
        "/v1/generate", json=body("ctx", sampling={"max_tokens": 5000}), headers=AUTH
    )
    assert too_long.status_code == 413
    error = msgspec.json.decode(too_long.content, type=ErrorBody).error
    requested, window = (int(n) for n in re.findall(r"\((\d+)\)", error.message))
    # over the model's 1,024 tokens too: the window named is still the replica's (its pool's 768)
    assert error.code == "context_window_exceeded" and requested > 5000 and window == 96 * 8
    pool = await client.post("/v1/generate", json=body("pool", sampling={"max_tokens": 1000}), headers=AUTH)
    assert pool.status_code == 413  # fits the model's 1024-token window, not the 96 pages of 8 tokens
    error = msgspec.json.decode(pool.content, type=ErrorBody).error
    requested, window = (int(n) for n in re.findall(r"\((\d+)\)", error.message))
    card = msgspec.json.decode((await client.get("/v1/model", headers=AUTH)).content, type=ModelCard)
    assert error.code == "context_window_exceeded" and window == card.max_request_tokens == 96 * 8
    image = body("img") | {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "see"}, {"type": "image", "data": "iVBORw0KGgo="}],
            }
        ]
    }
    refused = await client.post("/v1/generate", json=image, headers=AUTH)
    assert (
        refused.status_code == 400
        and msgspec.json.decode(refused.content, type=ErrorBody).error.code == "unsupported"
    )
    bad_schema = body("schema", response_format={"type": "json_schema", "json_schema": {"type": "strnig"}})
    assert (await client.post("/v1/generate", json=bad_schema, headers=AUTH)).status_code == 400
    # and the process keeps serving
    assert text_of(await generate(client, body("after-refusals", reasoning={"enabled": False})))


async def test_secret_is_required(client: httpx.AsyncClient) -> None:
    for method, path in [
        ("POST", "/v1/generate"),
        ("GET", "/v1/load"),
        ("GET", "/v1/model"),
        ("GET", "/metrics"),
    ]:
        for headers in [{}, {"authorization": "Bearer wrong-secret-000"}, {"authorization": SECRET}]:
            response = await client.request(method, path, headers=headers, json=body("auth"))
            assert response.status_code == 401, (path, headers)
            assert msgspec.json.decode(response.content, type=ErrorBody).error.code == "unauthorized"
    assert (await client.get("/v1/health")).json() == {"status": "ok"}


async def test_model_card(client: httpx.AsyncClient) -> None:
    card = msgspec.json.decode((await client.get("/v1/model", headers=AUTH)).content, type=ModelCard)
    assert (card.name, card.architecture, card.family, card.weights) == (
        "glm-5.2-tiny",
        "GlmMoeDsaForCausalLM",
        "glm",
        "float32",
    )
    assert card.context_window == 1024 and card.num_pages == 96 and card.page_size == 8
    assert card.capabilities.tools and card.capabilities.reasoning and not card.capabilities.vision
    # the start-up time is recorded, the CPU's warm-up (one step) a part of it
    assert card.startup_s is not None and card.warmup_s is not None and 0 < card.warmup_s < card.startup_s


async def test_logprobs_and_prefix_cache_usage(
    client: httpx.AsyncClient, backend_process: RunningBackend
) -> None:
    long_prompt = "The tenant sends a request, the gateway routes it to a backend. " * 3
    first = await generate(
        client,
        body(
            "lp-1",
            long_prompt,
            reasoning={"enabled": False},
            sampling={"max_tokens": 4, "logprobs": True, "top_logprobs": 2},
        ),
    )
    logprobs = [lp for e in first if isinstance(e, TextDelta) and e.logprobs for lp in e.logprobs]
    assert len(logprobs) == 4
    assert all(
        lp.logprob <= 0 and len(lp.top) == 2 and lp.top[0].logprob >= lp.top[1].logprob for lp in logprobs
    )
    tok = load_tokenizer(backend_process.model_dir)
    assert all(lp.token == tok.decode([lp.token_id]) for lp in logprobs)
    second = await generate(
        client, body("lp-2", long_prompt, reasoning={"enabled": False}, sampling={"max_tokens": 4})
    )
    usage = next(e for e in second if isinstance(e, Usage))
    assert usage.cached_tokens >= 8 and usage.cached_tokens < usage.prompt_tokens  # whole pages of the prompt
    # the paired assertion across the wire: the gateway's salt, not the prompt, decides sharing
    other_tenant = await generate(
        client,
        body(
            "lp-3",
            long_prompt,
            tenant_salt="cd" * 16,
            reasoning={"enabled": False},
            sampling={"max_tokens": 4, "prompt_logprobs": True},
        ),
    )
    other_usage = next(e for e in other_tenant if isinstance(e, Usage))
    assert other_usage.cached_tokens == 0 and other_usage.prompt_tokens == usage.prompt_tokens
    assert text_of(other_tenant) == text_of(second)
    # prompt log-probs ride on usage, one per prompt token (the first has no context)
    scored = other_usage.prompt_logprobs
    assert scored is not None and len(scored) == other_usage.prompt_tokens and scored[0] is None
    assert all(lp is not None and lp.logprob <= 0 for lp in scored[1:])

"""BackendClient against `httpx.MockTransport`: what a backend sends is untrusted input
(reliability §4.1, API10), so its lines are capped while they stream in, not after."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest

from gateway import backend_client
from gateway.backend_client import BackendClient
from gateway.errors import KumoError
from schemas import backend as b

URL = "http://backend.test"


def client(body: AsyncIterator[bytes]) -> BackendClient:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})

    return BackendClient(httpx.AsyncClient(transport=httpx.MockTransport(handler)), {URL: "secret"})


def request() -> b.GenerateRequest:
    return b.GenerateRequest(request_id="r-0", tenant_salt="s", prompt="x", raw=True)


async def events_of(c: BackendClient) -> list[b.Event]:
    async with c.generate(URL, request()) as events:
        return [event async for event in events]


async def test_events_split_across_chunks_are_decoded() -> None:
    lines = [msgspec.json.encode(b.TextDelta(text="hel")), msgspec.json.encode(b.Finish(reason="stop"))]
    wire = b"\n".join(lines) + b"\n\n"

    async def body() -> AsyncIterator[bytes]:
        for i in range(0, len(wire), 5):
            yield wire[i : i + 5]

    assert await events_of(client(body())) == [b.TextDelta(text="hel"), b.Finish(reason="stop")]


async def test_a_line_without_end_is_cut_off_at_the_cap(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend_client, "MAX_LINE_BYTES", 64 * 1024)
    sent = 0

    async def endless() -> AsyncIterator[bytes]:
        nonlocal sent
        for _ in range(1000):  # 16 MB, never a newline
            sent += 1
            yield b"x" * 16 * 1024

    with pytest.raises(KumoError, match="Unknown internal error"):
        await events_of(client(endless()))
    assert sent <= 6  # refused once the cap was passed, not after buffering the whole line

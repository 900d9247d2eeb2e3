# ruff: noqa: F811  (pytest fixtures imported by name)
"""BackendClient against `httpx.MockTransport`: what a backend sends is untrusted input
(reliability §4.1, API10), so its lines are capped while they stream in, not after. Against a fake
backend over HTTP: whether a replica holds a request (`Dispatch`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
from gateway_harness import Harness, harness  # noqa: F401  (fixture)

from gateway import backend_client
from gateway.backend_client import BackendClient, ReplicaFailed
from gateway.errors import ContextWindowExceeded, KumoError
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


async def test_dispatch_says_whether_a_replica_holds_the_request(harness: Harness) -> None:
    """Set once the request's whole body is sent (a replica answers nothing before its first event,
    yet may be prefilling), cleared when the replica refuses it; never set when the request cannot
    be sent."""
    url = harness.services.router.pools["glm-5.2"].replicas[0].url
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    async with httpx.AsyncClient(trust_env=False) as http:
        c = BackendClient(http, {url: "fake-secret", closed: "fake-secret"})
        held = backend_client.Dispatch()

        async def prefill() -> None:
            async with c.generate(url, request_for("prefill"), held):  # nothing comes for 1.5 s
                pass

        waiting = asyncio.create_task(prefill())
        for _ in range(50):
            if held.is_held:
                break
            await asyncio.sleep(0.02)
        assert held.is_held and not waiting.done()  # sent, not answered yet
        waiting.cancel()  # a deadline: the replica may have been prefilling, and still counts so
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        assert held.is_held
        for text, refusal in (("busy", ReplicaFailed), ("overflow", ContextWindowExceeded)):
            refused = backend_client.Dispatch()
            with pytest.raises(refusal):
                async with c.generate(url, request_for(text), refused):
                    pass
            assert not refused.is_held, text
        unsent = backend_client.Dispatch()
        with pytest.raises(ReplicaFailed):
            async with c.generate(closed, request_for("hello"), unsent):
                pass
        assert not unsent.is_held


def request_for(text: str) -> b.GenerateRequest:
    return b.GenerateRequest(request_id=f"r-{text}", tenant_salt="0" * 16, prompt=text, raw=True)

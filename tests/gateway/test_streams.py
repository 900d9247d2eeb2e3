# ruff: noqa: F811  (pytest fixtures imported by name)
"""Stream lifecycle: a client that goes away aborts the backend request and is still metered; a
client that trickles its body times out; every request lands in the usage ledger."""

from __future__ import annotations

import asyncio
import datetime as dt
from collections.abc import AsyncGenerator

import anyio
import msgspec
import pytest
from fake_backend import FakeBackend
from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)

from gateway import render
from gateway.inference import CallMeta, ChoiceEvents, Prompt, Stream, TooSlow, input_decoder, merge
from gateway.run import StreamResponse
from schemas import backend as b


async def usage_by_model(h: Harness, account: str) -> dict[str, tuple[int, int]]:
    await h.services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    rows = await h.services.store.usage(account, since=today, until=today, group_by="model")
    return {r.model or "": (r.requests, r.completion_tokens) for r in rows}


async def until_closed(backend: FakeBackend) -> None:
    """Wait (2.5 s at most) until the backend has no stream open: the gateway closed them all."""
    for _ in range(50):
        if backend.num_open_streams == 0:
            return
        await asyncio.sleep(0.05)
    assert backend.num_open_streams == 0


async def test_a_client_disconnect_closes_the_backend_stream(harness: Harness) -> None:
    backend = harness.backends["glm-5.2"][0]
    before = await usage_by_model(harness, harness.account)
    async with harness.http.stream(
        "POST",
        harness.path(f"/ai/run/{GLM}"),
        headers=harness.auth(),
        json={"prompt": "slow", "stream": True},
    ) as r:
        async for line in r.aiter_lines():
            if '"content":"ech' in line:
                break
        assert backend.num_open_streams == 1
    await until_closed(backend)
    after = await usage_by_model(harness, harness.account)
    assert after[GLM][0] == before.get(GLM, (0, 0))[0] + 1  # the abandoned request is still recorded


async def test_a_cut_stream_is_billed_the_prompt_the_backend_counted(harness: Harness) -> None:
    """A stream the client leaves before the backend's usage came is billed the prompt as the backend
    counted it in its first event (7 + len("slow") tokens on the fake backend), and a token per delta
    delivered: not the gateway's estimate from the body's bytes plus the template's allowance."""
    await harness.services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    before = await harness.services.store.usage(harness.account, since=today, until=today, group_by="model")
    old = next((r for r in before if r.model == GLM), None)
    async with harness.http.stream(
        "POST",
        harness.path(f"/ai/run/{GLM}"),
        headers=harness.auth(),
        json={"prompt": "slow", "stream": True, "max_tokens": 64},
    ) as r:
        async for line in r.aiter_lines():
            if '"content":"ech' in line:
                break
    for _ in range(50):
        await harness.services.ledger.flush()
        rows = await harness.services.store.usage(harness.account, since=today, until=today, group_by="model")
        new = next((r for r in rows if r.model == GLM), None)
        if new is not None and new.requests > (old.requests if old else 0):
            break
        await asyncio.sleep(0.05)
    assert new is not None and new.requests == (old.requests if old else 0) + 1
    assert new.prompt_tokens - (old.prompt_tokens if old else 0) == 7 + len("slow")
    assert 1 <= new.completion_tokens - (old.completion_tokens if old else 0) <= 3


async def test_a_slow_body_times_out(harness: Harness) -> None:
    async def trickle():  # type: ignore[no-untyped-def]
        yield b'{"prompt": '
        await asyncio.sleep(1.5)
        yield b'"x"}'

    r = await harness.http.post(harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), content=trickle())
    assert r.status_code == 408 and r.json()["errors"][0]["code"] == 3046


async def test_usage_is_recorded_per_request(harness: Harness) -> None:
    before = await usage_by_model(harness, harness.account)
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": "count me", "n": 2}
    )
    completion = r.json()["result"]["usage"]["completion_tokens"]
    after = await usage_by_model(harness, harness.account)
    old_requests, old_tokens = before.get(KIMI, (0, 0))
    assert after[KIMI] == (old_requests + 1, old_tokens + completion)


async def test_many_streams_with_disconnects_leave_nothing_behind(harness: Harness) -> None:
    """40 concurrent slow streams, every other one abandoned after its first frame: afterwards no
    backend stream, router slot or in-flight request is left (reliability §2.4)."""
    backend = harness.backends["glm-5.2"][0]

    async def one(i: int) -> str | None:
        async with harness.http.stream(
            "POST",
            harness.path(f"/ai/run/{GLM}"),
            headers=harness.auth(),
            json={"prompt": "slow", "stream": True},
        ) as r:
            text = ""
            async for line in r.aiter_lines():
                text += line
                if i % 2 and '"content":"ech' in line:
                    return None
            return text

    results = await asyncio.gather(*(one(i) for i in range(40)))
    finished = [t for t in results if t is not None]
    assert len(finished) == 20 and all("[DONE]" in t and '"usage"' in t for t in finished)
    for _ in range(60):
        replicas = harness.services.router.pools["glm-5.2"].replicas
        if backend.num_open_streams == 0 and all(r.num_in_flight == 0 for r in replicas):
            break
        await asyncio.sleep(0.05)
    assert backend.num_open_streams == 0
    assert all(r.num_in_flight == 0 for r in harness.services.router.pools["glm-5.2"].replicas)
    assert harness.services.metrics.registry.get_sample_value("kumo_gateway_requests_in_flight") == 0


async def test_a_choice_failing_beside_a_running_one_ends_both_and_is_billed_once(harness: Harness) -> None:
    """n = 2 without streaming: the first choice's backend crashes mid-answer while the second is
    still generating. The caller gets the API's error (not a RuntimeError from closing a stream still
    being read), the second choice's backend request is closed at once, and the call is settled and
    recorded exactly once (it once skipped the settlement: the worst case stayed reserved all day)."""
    backends = harness.backends["kimi-k2.6"]  # both choices go to one of them (the call's affinity)
    before = await usage_by_model(harness, harness.account)
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": "crash-one", "n": 2}
    )
    assert r.status_code == 500 and r.json()["errors"][0]["code"] == 3000
    assert r.json()["success"] is False
    assert sorted(b.num_crash_one for b in backends)[-1] == 2
    for _ in range(20):
        if all(b.num_open_streams == 0 for b in backends):
            break
        await asyncio.sleep(0.05)
    assert all(b.num_open_streams == 0 for b in backends)  # the slow choice did not run on (~2 s)
    after = await usage_by_model(harness, harness.account)
    assert after[KIMI][0] == before.get(KIMI, (0, 0))[0] + 1
    replicas = harness.services.router.pools["kimi-k2.6"].replicas
    assert all(rep.num_in_flight == 0 for rep in replicas)


async def test_a_client_that_leaves_a_non_streaming_request_stops_it(harness: Harness) -> None:
    """A non-streaming answer sends nothing before it is whole, so only the disconnect itself tells
    that its client gave up (a first-hour probe's `curl -m 4` left 1,500 tokens generating for 45 s,
    billed; the OpenAI SDK retries a timeout twice): the backend stream closes at once, and the
    request is still recorded."""
    import httpx

    backend = harness.backends["glm-5.2"][0]
    before = await usage_by_model(harness, harness.account)
    body = {"prompt": "slow"}  # ~0.3 s an event, seconds in all
    with_timeout = httpx.AsyncClient(base_url=str(harness.http.base_url), timeout=0.6)
    async with with_timeout:
        try:
            await with_timeout.post(harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json=body)
            raise AssertionError("the slow answer came within 0.6 s")
        except httpx.ReadTimeout:
            left = asyncio.get_running_loop().time()
    while backend.num_open_streams and asyncio.get_running_loop().time() - left < 5:
        await asyncio.sleep(0.02)
    assert backend.num_open_streams == 0
    assert asyncio.get_running_loop().time() - left < 0.5  # closed when the client left, not at the end
    after = await usage_by_model(harness, harness.account)
    assert after[GLM][0] == before.get(GLM, (0, 0))[0] + 1


def backend_events(num: int, *, ends: bool, closed: list[bool], into: render.Completion) -> ChoiceEvents:
    """A choice whose backend sends `num` deltas at once, then (`ends`) its finish and usage, or
    nothing more; `closed` notes when the gateway closes it (the engine aborts the request)."""

    async def events() -> AsyncGenerator[tuple[str, b.Event], None]:
        try:
            for i in range(1, num):
                yield "replica", b.TextDelta(text=f"t{i}")
            if ends:
                yield "replica", b.Finish(reason="length")
                yield "replica", b.Usage(prompt_tokens=5, completion_tokens=num)
                return
            await asyncio.Event().wait()  # generating on, slowly
        finally:
            closed.append(True)

    return ChoiceEvents(b.TextDelta(text="t0"), events(), into)


async def test_a_client_that_stops_taking_its_stream_is_billed_what_the_backend_sent() -> None:
    """The client takes two events of a stream and stops reading (staying connected): the backend's
    events are read on regardless, so the stream, cut later, is billed what the engine computed
    (once billed what the client took: a long answer went mostly free)."""
    for ends in (True, False):
        closed: list[bool] = []
        done = [render.Completion(is_started=True)]
        merged = merge([backend_events(40, ends=ends, closed=closed, into=done[0])])
        taken = [await anext(merged), await anext(merged)]
        for event in (e for _, e in taken):
            done[0].feed(event)
        await asyncio.sleep(0.05)  # the client reads nothing meanwhile
        await merged.aclose()
        assert closed == [True] and done[0].num_pieces == 2
        assert done[0].consumed(prompt_tokens=5).completion_tokens == 40, ends


async def test_a_client_too_far_behind_has_its_stream_cut() -> None:
    """Past `max_unread` events not taken, the backend is closed (the engine stops generating for a
    client that reads nothing), the events read stay the client's, then the stream ends TooSlow;
    all of them are billed."""
    closed: list[bool] = []
    done = [render.Completion(is_started=True)]
    merged = merge([backend_events(10_000, ends=False, closed=closed, into=done[0])], max_unread=16)
    first = await anext(merged)
    await asyncio.sleep(0.05)
    assert closed == [True]
    rest = []
    with pytest.raises(TooSlow):
        async for item in merged:
            rest.append(item)
    assert [e.text for _, e in [first, *rest]] == [f"t{i}" for i in range(17)]  # type: ignore[union-attr]
    assert done[0].consumed(prompt_tokens=5).completion_tokens == 17
    assert (TooSlow.status, TooSlow.code) == (408, 3008)


async def test_a_client_gone_through_anyio_still_closes_the_backend_stream() -> None:
    """Starlette cancels a streaming response through anyio, again at every await until it ends: the
    pumps' closing of their backend connections (which httpcore shields from anyio alone) must not be
    cancelled a second time (it once was: the connection stayed open, the engine generating)."""
    closed: list[str] = []

    async def events() -> AsyncGenerator[tuple[str, b.Event], None]:
        try:
            while True:
                await asyncio.sleep(0.01)
                yield "replica", b.TextDelta(text="t")
        finally:
            with anyio.CancelScope(shield=True):  # as httpcore closes a connection
                await anyio.sleep(0.05)
            closed.append("closed")

    done = [render.Completion(is_started=True)]
    merged = merge([ChoiceEvents(b.TextDelta(text="t"), events(), done[0])])
    with anyio.move_on_after(0.05):  # the client leaves while the response awaits the next event
        async for _ in merged:
            pass
    with anyio.CancelScope(shield=True):
        await merged.aclose()
    assert closed == ["closed"]


async def test_a_stream_whose_response_never_started_is_closed_and_billed(harness: Harness) -> None:
    """A streaming response cancelled before its first frame never starts its frames' generator, so
    its clean-up never ran: `Stream.close` (which the response runs however it ends) closes the backend
    request and bills what it had begun; closing again does nothing."""
    backend = harness.backends["glm-5.2"][0]
    services = harness.services
    before = await usage_by_model(harness, harness.account)
    tenant = await services.authenticator.authenticate(harness.auth()["authorization"], harness.account)
    model = services.catalog.get(GLM)
    raw = b'{"prompt": "slow", "stream": true}'
    body = msgspec.json.decode(raw, type=input_decoder(model, "run").type)
    stream = await services.inference.run(tenant, model, Prompt(body, raw), "run", CallMeta())
    assert isinstance(stream, Stream) and backend.num_open_streams == 1
    await stream.close()
    await stream.close()
    await until_closed(backend)
    after = await usage_by_model(harness, harness.account)
    old_requests, old_tokens = before.get(GLM, (0, 0))
    assert after[GLM][0] == old_requests + 1 and after[GLM][1] >= old_tokens + 1


async def test_a_backlog_taken_at_once_still_lets_a_cancel_in() -> None:
    """Once a client is gone every send returns at once, so a consumer taking a read-ahead backlog
    never suspended and the cancel that says so waited for all of it (the loop blocked ~0.5 s a
    stream): it suspends every 64 events."""
    done = [render.Completion(is_started=True)]
    merged = merge([backend_events(10_000, ends=True, closed=[], into=done[0])])
    taken = 0
    with anyio.CancelScope() as scope:
        async for _ in merged:
            taken += 1
            if taken == 2:
                scope.cancel()  # delivered at the consumer's next suspension
    with anyio.CancelScope(shield=True):
        await merged.aclose()
    assert 2 <= taken <= 64


async def test_a_client_that_takes_nothing_is_cut_after_the_stall_and_its_stream_closed() -> None:
    """A client that stays connected but takes no frame blocks the response's send for good (uvicorn
    has no write timeout): after `stall_s` it is cut as gone and its stream closed (settled) then."""
    closed: list[bool] = []

    async def frames() -> AsyncGenerator[bytes, None]:
        while True:
            yield b"data: {}\n\n"

    async def close() -> None:
        closed.append(True)

    sent: list[dict[str, object]] = []

    async def send(message: dict[str, object]) -> None:
        sent.append(message)
        if len(sent) > 3:  # the client's window is full: nothing more goes out
            await asyncio.Event().wait()

    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()  # connected, silent
        return {}

    response = StreamResponse(Stream(frames(), close=close), stall_s=0.2)
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "headers": []}
    async with asyncio.timeout(5):
        await response(scope, receive, send)  # type: ignore[arg-type]
    assert closed == [True] and len(sent) == 4


async def test_a_response_that_fails_raises_its_own_error_and_closes_its_stream() -> None:
    """The watchdog's task group must not turn a failing response's error into an ExceptionGroup
    (the app's handlers and uvicorn's log read the error itself); the stream is closed either way."""
    closed: list[bool] = []

    async def frames() -> AsyncGenerator[bytes, None]:
        yield b"data: {}\n\n"
        raise RuntimeError("a renderer's bug")

    async def close() -> None:
        closed.append(True)

    async def send(message: dict[str, object]) -> None:
        pass

    async def receive() -> dict[str, object]:
        await asyncio.Event().wait()
        return {}

    response = StreamResponse(Stream(frames(), close=close))
    scope = {"type": "http", "asgi": {"spec_version": "2.3"}, "method": "POST", "headers": []}
    with pytest.raises(RuntimeError, match="a renderer's bug"):
        await response(scope, receive, send)  # type: ignore[arg-type]
    assert closed == [True]

# ruff: noqa: F811  (pytest fixtures imported by name)
"""Lifecycle: a real `kumo gateway` process drained by SIGTERM, the per-request wall-clock limit,
the drain gate, retry headers, and children that die with their parent."""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path
from urllib.parse import urlsplit

import anyio
import httpx
import pytest
from gateway_harness import GLM, KIMI, Harness, _tenant, harness, standalone_gateway  # noqa: F401  (fixture)
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from gateway.errors import Aborted, Busy, NeuronsExhausted, RateLimited, Timeout, Unavailable, retry_headers
from gateway.lifecycle import DrainGate, Lifecycle, request_timeout_s
from gateway.quotas import Admission, Limiter
from gateway.services import image_fetcher

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "kumo_admin_for_the_lifecycle_test_0123456789"


def sse(text: str) -> list[dict]:  # type: ignore[type-arg]
    return [json.loads(line[6:]) for line in text.split("\n\n") if line.startswith("data: {")]


def error_code(frame: dict) -> int | None:  # type: ignore[type-arg]
    """The Workers AI code of an in-stream error frame (OpenAI-family `error` object), else None."""
    return frame["error"]["code"] if "error" in frame else None


@pytest.mark.slow  # a real gateway process
async def test_a_generation_past_its_wall_clock_limit_ends_with_3046(harness: Harness) -> None:
    # the fake backend's "slow" script sends one event every 0.3 s (≈1.8 s in all)
    limit = {"cf-aig-request-timeout": "500", **harness.auth()}
    body = {"messages": [{"role": "user", "content": "slow"}]}
    started = time.monotonic()
    r = await harness.http.post(harness.path(f"/ai/run/{GLM}"), headers=limit, json=body)
    assert r.status_code == 408, r.text
    assert r.json()["errors"][0]["code"] == 3046 and time.monotonic() - started < 1.5
    r = await harness.http.post(harness.path(f"/ai/run/{GLM}"), headers=limit, json={**body, "stream": True})
    assert r.status_code == 200
    frames = sse(r.text)
    assert error_code(frames[-1]) == 3046, frames
    # without the header the configured limit (600 s) applies and the same request completes
    r = await harness.http.post(harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json=body)
    assert r.status_code == 200 and r.json()["result"]["choices"][0]["message"]["content"] == "echo: slow"
    await asyncio.sleep(0.1)
    assert all(b.num_open_streams == 0 for b in harness.backends["glm-5.2"])  # backend requests closed


@pytest.fixture
async def never_answering_site() -> AsyncIterator[str]:
    """An image server that accepts connections and never answers: its URL."""

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # until the gateway hangs up
        writer.close()

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    async with server:
        yield f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/cat.png"


async def test_the_request_deadline_bounds_its_image_fetches(
    harness: Harness, never_answering_site: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 500 ms `cf-aig-request-timeout` with an image URL that never answers is the generation's
    408/3046 at the deadline, not a 400 at the fetch limit (10 s): billed nothing, its reservation
    given back whole."""
    services = harness.services
    settings = replace(
        services.settings, image_fetch_timeout_s=10.0, allowed_image_networks=("127.0.0.1/32",)
    )
    http, images = image_fetcher(settings)
    monkeypatch.setattr(services, "images", images)
    settled = spy_on_settle(services.limiter, monkeypatch)
    account, token = await _tenant(services, "image-deadline", "paid")
    image = {"type": "image_url", "image_url": {"url": never_answering_site}}
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]}
    started = time.monotonic()
    async with http:
        r = await harness.http.post(
            harness.path(f"/ai/run/{KIMI}", account),
            headers={"cf-aig-request-timeout": "500", **harness.auth(token)},
            json=body,
        )
    assert r.status_code == 408 and r.json()["errors"][0] == {
        "code": 3046,
        "message": "AiError: Request timeout",
    }
    assert 0.4 < time.monotonic() - started < 3, r.text
    [(reserved, spent)] = settled
    assert reserved > 0 and spent == 0  # the worst case reserved at admission, all of it refunded
    await services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    [row] = await services.store.usage(account, since=today, until=today, group_by="model")
    assert (row.requests, row.prompt_tokens, row.completion_tokens, row.neurons) == (1, 0, 0, 0)


async def test_the_request_deadline_bounds_reading_its_body(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A body still unfinished when a 300 ms deadline passes is answered 408/3046 then, though the
    body's own read limit is longer (10 s here). A raw connection, which reads the answer while the
    body is unsent (an HTTP client would finish sending first)."""
    settings = replace(harness.services.settings, body_read_timeout_s=10.0)
    monkeypatch.setattr(harness.services, "settings", settings)
    url = urlsplit(harness.path(f"/ai/run/{KIMI}"))
    body = b'{"prompt": "x"}'
    head = (
        f"POST {url.path} HTTP/1.1\r\nhost: {url.netloc}\r\n"
        f"authorization: {harness.auth()['authorization']}\r\ncf-aig-request-timeout: 300\r\n"
        f"content-type: application/json\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    reader, writer = await asyncio.open_connection(url.hostname, url.port)
    try:
        writer.write(head.encode() + body[:5])  # the rest never comes
        started = time.monotonic()
        status = await asyncio.wait_for(reader.readline(), 5)
        elapsed = time.monotonic() - started
        answer = await asyncio.wait_for(reader.readuntil(b"3046"), 5)
    finally:
        writer.close()
    assert status.startswith(b"HTTP/1.1 408 ") and b'"code":3046' in answer, (status, answer)
    assert elapsed < 2


async def test_a_wait_whose_deadline_has_passed_is_not_begun() -> None:
    """A deadline that passed while nothing waited (admission, say) ends the next wait before it
    begins: no replica is dialled for a request already out of time."""
    lifecycle = Lifecycle()
    began = False
    with pytest.raises(Timeout):
        async with lifecycle.bounded(asyncio.get_running_loop().time()):
            began = True
    assert not began


async def test_a_deadline_waits_for_shielded_cleanup_and_the_drain_moves_it() -> None:
    """A deadline falling while the wait closes connections under anyio's shield (httpx's pool
    does: encode/httpcore#830) ends the wait after the shielded part, not inside it, which would
    leave the pool's other connections open; a drain starting later pulls the deadline in."""
    lifecycle = Lifecycle()
    loop = asyncio.get_running_loop()
    closed: list[int] = []
    with pytest.raises(Timeout):
        async with lifecycle.bounded(loop.time() + 0.02):
            with anyio.CancelScope(shield=True):
                for connection in range(3):
                    await asyncio.sleep(0.02)  # the deadline falls in the first close
                    closed.append(connection)
            await asyncio.sleep(10)
    assert closed == [0, 1, 2]
    start = loop.time()
    with pytest.raises(Aborted):
        async with lifecycle.bounded(loop.time() + 10):
            loop.call_later(0.01, lifecycle.begin_drain, 0.05)
            await asyncio.sleep(10)
    assert loop.time() - start < 1


def spy_on_settle(limiter: Limiter, monkeypatch: pytest.MonkeyPatch) -> list[tuple[float, float]]:
    """Every settlement from now on: (neurons reserved at admission, neurons spent)."""
    settled: list[tuple[float, float]] = []
    settle = limiter.settle

    async def spy(admission: Admission, *, tokens: int, neurons: float) -> None:
        settled.append((admission.reserved_neurons, neurons))
        await settle(admission, tokens=tokens, neurons=neurons)

    monkeypatch.setattr(limiter, "settle", spy)
    return settled


def test_request_timeout_header_only_lowers_the_limit() -> None:
    assert request_timeout_s({}, 600) == 600
    assert request_timeout_s({"cf-aig-request-timeout": "2500"}, 600) == 2.5
    assert request_timeout_s({"cf-aig-request-timeout": "9999999"}, 600) == 600
    assert request_timeout_s({"cf-aig-request-timeout": "-5"}, 600) == 600
    assert request_timeout_s({"cf-aig-request-timeout": "0"}, 600) == 600


def test_429_and_503_say_when_to_retry() -> None:
    assert retry_headers(Busy("x", retry_after=2)) == {"retry-after": "2", "x-should-retry": "true"}
    assert retry_headers(Unavailable("x")) == {"retry-after": "1", "x-should-retry": "true"}
    assert retry_headers(RateLimited("x", retry_after=30))["x-should-retry"] == "true"
    spent = retry_headers(NeuronsExhausted("x", retry_after=3600))
    assert spent == {"retry-after": "3600", "x-should-retry": "false"}


async def test_no_capacity_is_503_with_retry_after(harness: Harness) -> None:
    backends = harness.backends["glm-5.2"]
    for b in backends:
        b.is_down = True
    try:
        for _ in range(50):  # until the health loop has ejected the replica
            r = await harness.http.post(
                harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json={"prompt": "hi"}
            )
            if r.status_code == 503:
                break
            await asyncio.sleep(0.1)
        assert r.status_code == 503 and r.json()["errors"][0]["code"] == 3040, r.text
        assert int(r.headers["retry-after"]) >= 1 and r.headers["x-should-retry"] == "true"
    finally:
        for b in backends:
            b.is_down = False
    for _ in range(50):
        r = await harness.http.post(
            harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json={"prompt": "hi"}
        )
        if r.status_code == 200:
            break
        await asyncio.sleep(0.1)
    assert r.status_code == 200


async def test_the_drain_gate_refuses_new_requests() -> None:
    lifecycle = Lifecycle()
    app = DrainGate(Starlette(routes=[Route("/", lambda r: PlainTextResponse("ok"))]), lifecycle)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://t") as http:
        assert (await http.get("/")).text == "ok"
        lifecycle.begin_drain(5)
        r = await http.get("/")
    assert r.status_code == 503 and r.json()["errors"][0]["code"] == 3040 and r.json()["result"] is None
    assert r.headers["retry-after"] == "1" and r.headers["x-should-retry"] == "true"


@pytest.mark.slow  # a real gateway process
async def test_sigterm_drains_a_real_gateway(harness: Harness, tmp_path: Path) -> None:
    """Two streams are running when SIGTERM comes: the one that ends before the drain deadline
    finishes normally, the longer one ends with a 3008 error frame; new connections are refused."""
    async with standalone_gateway(harness, tmp_path, admin_token=ADMIN, KUMO_DRAIN_TIMEOUT_S="2.2") as g:
        http, url, proc = g.http, g.url, g.proc
        run = f"{url}/client/v4/accounts/{g.account}/ai/run/{GLM}"
        auth = {"authorization": f"Bearer {g.token}"}

        async def stream(seed: int | None) -> str:
            body: dict[str, object] = {"messages": [{"role": "user", "content": "slow"}], "stream": True}
            if seed is not None:
                body["seed"] = seed
            async with http.stream("POST", run, headers=auth, json=body) as r:
                assert r.status_code == 200
                return "".join([chunk async for chunk in r.aiter_text()])

        short = asyncio.create_task(stream(None))  # 6 events: ≈1.8 s
        long = asyncio.create_task(stream(123456789012345))  # 11 events: ≈3.3 s
        await asyncio.sleep(0.4)
        proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.3)
        with pytest.raises(httpx.TransportError):  # the listening socket is closed
            await http.get(f"{url}/healthz")
        short_frames, long_frames = sse(await short), sse(await long)
        await asyncio.wait_for(proc.wait(), 10)
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in short_frames if c.get("choices"))
    assert text == "echo: slow" and not any(error_code(f) for f in short_frames)
    assert error_code(long_frames[-1]) == 3008, long_frames[-1]
    assert not any(error_code(f) for f in long_frames[:-1])
    await asyncio.sleep(0.1)
    assert all(b.num_open_streams == 0 for b in harness.backends["glm-5.2"])


@pytest.mark.slow  # a real gateway process
async def test_sigterm_aborts_a_request_still_fetching_its_image(harness: Harness, tmp_path: Path) -> None:
    """A request whose image server answers nothing is still fetching at the drain deadline: it is
    answered with the 3008 abort error, not cut off when the process exits."""
    accepted = asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.set()
        await reader.read()  # until the gateway hangs up
        writer.close()

    image_server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = image_server.sockets[0].getsockname()[1]
    env = {"KUMO_DRAIN_TIMEOUT_S": "1", "KUMO_ALLOW_PRIVATE_URLS": "1"}
    async with image_server, standalone_gateway(harness, tmp_path, admin_token=ADMIN, **env) as g:
        image = {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{port}/cat.png"}}
        body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "what?"}, image]}]}
        run = f"{g.url}/client/v4/accounts/{g.account}/ai/run/{KIMI}"
        request = asyncio.create_task(
            g.http.post(run, headers={"authorization": f"Bearer {g.token}"}, json=body)
        )
        await asyncio.wait_for(accepted.wait(), 10)
        g.proc.send_signal(signal.SIGTERM)
        started = time.monotonic()
        r = await request
        assert r.status_code == 408 and r.json()["errors"][0]["code"] == 3008, r.text
        assert 0.8 < time.monotonic() - started < 5  # at the drain deadline, not the 10 s fetch limit
        await asyncio.wait_for(g.proc.wait(), 10)


def test_children_die_with_their_parent(tmp_path: Path) -> None:
    """A parent spawns a child with `die_with_parent` and is SIGKILLed: the kernel kills the child."""
    script = (
        "import functools, os, subprocess, sys, time\n"
        "from schemas.child_process import die_with_parent\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " preexec_fn=functools.partial(die_with_parent, os.getpid()))\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", script],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert Path(f"/proc/{child}").exists()
    parent.kill()
    parent.wait()
    parent.stdout.close()
    for _ in range(100):
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child), "the child outlived its SIGKILLed parent"


def _alive(pid: int) -> bool:
    """Running and not a zombie waiting for its (new) parent to reap it."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

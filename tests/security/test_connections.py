"""Rows 1 and 3 of issue 27, against a real `kumo gateway` process (uvicorn, the fake backends):
idle and header-trickling (slowloris) connections are closed at the header deadline while normal
traffic goes on; connections over the cap are refused at once (503, closed); an oversized header is
refused with 431 quickly, and the gateway's memory does not grow with the header's size.

The gateway runs with small limits so the attacks stay short: a 1.5 s header deadline, at most 60
connections, 40 of them from one client, 32 KiB of request head. Clients are told apart by their
source address: loopback's 127.0.0.0/8 gives the tests as many as they need.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from gateway_harness import GLM, Harness, Standalone, standalone_gateway

from schemas.http_protocol import client_key

HEADER_TIMEOUT_S = 1.5
MAX_CONNECTIONS = 60
MAX_PER_CLIENT = 40
ATTACK_BOUND_S = 10.0  # no attack connection is kept longer than this, whatever the gateway does


@pytest.fixture(scope="module")
async def gateway(harness: Harness, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Standalone]:
    env = {
        "KUMO_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "KUMO_MAX_CONNECTIONS": str(MAX_CONNECTIONS),
        "KUMO_MAX_CONNECTIONS_PER_CLIENT": str(MAX_PER_CLIENT),
    }
    tmp: Path = tmp_path_factory.mktemp("limits")
    async with standalone_gateway(harness, tmp, admin_token="limits-admin", **env) as g:
        yield g


def _host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").split(":")
    return host, int(port)


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


async def _read_until_closed(reader: asyncio.StreamReader, timeout_s: float) -> bytes | None:
    """Everything the server sends until it closes; None if it is still open after `timeout_s`."""
    received = b""
    deadline = time.monotonic() + timeout_s
    try:
        while chunk := await asyncio.wait_for(reader.read(65536), deadline - time.monotonic()):
            received += chunk
    except TimeoutError:
        return None
    except ConnectionResetError:
        pass
    return received


async def idle(url: str, source: str | None = None) -> tuple[bytes | None, float]:
    """Connect (from the `source` address) and send nothing: what the server answered (None: still
    open) and after how long."""
    started = time.monotonic()
    local = None if source is None else (source, 0)
    reader, writer = await asyncio.open_connection(*_host_port(url), local_addr=local)
    try:
        return await _read_until_closed(reader, ATTACK_BOUND_S), time.monotonic() - started
    finally:
        writer.close()


async def trickle(url: str, source: str | None = None) -> tuple[bytes | None, float]:
    """Slowloris: a request line, then one header byte every 0.1 s, never finishing the head."""
    started = time.monotonic()
    local = None if source is None else (source, 0)
    reader, writer = await asyncio.open_connection(*_host_port(url), local_addr=local)
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-slow: ")
        while time.monotonic() - started < ATTACK_BOUND_S:
            try:
                writer.write(b"a")
                await writer.drain()
            except ConnectionError:
                break
            try:
                first = await asyncio.wait_for(reader.read(65536), 0.1)
            except TimeoutError:
                continue
            rest = await _read_until_closed(reader, 2.0) if first else b""
            return first + (rest or b""), time.monotonic() - started
        return await _read_until_closed(reader, 0.1), time.monotonic() - started
    finally:
        writer.close()


async def big_header(url: str, size: int) -> tuple[bytes | None, float]:
    """One request whose single header value is `size` bytes, sent as fast as the socket takes it."""
    started = time.monotonic()
    reader, writer = await asyncio.open_connection(*_host_port(url))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\nx-big: ")
        piece = b"b" * min(size, 1024 * 1024)
        try:
            for _ in range(size // len(piece)):
                writer.write(piece)
                await writer.drain()
            writer.write(b"\r\n\r\n")
            await writer.drain()
        except ConnectionError:
            pass  # refused and closed while we were still sending: read what it answered
        return await _read_until_closed(reader, ATTACK_BOUND_S), time.monotonic() - started
    finally:
        writer.close()


def _error(answer: bytes | None) -> tuple[int, str]:
    """The (code, message) of a refusal's body: the Workers AI error envelope, as JSON."""
    assert answer is not None
    head, _, body = answer.partition(b"\r\n\r\n")
    assert b"content-type: application/json" in head.lower(), head
    envelope = json.loads(body)
    assert envelope["success"] is False and envelope["result"] is None, envelope
    [error] = envelope["errors"]
    return error["code"], error["message"]


def _status(answer: bytes | None) -> str:
    if answer is None:
        return "still open"
    return answer.split(b"\r\n", 1)[0].decode() if answer else "closed without an answer"


async def test_slowloris_and_idle_connections_are_closed_while_traffic_goes_on(gateway: Standalone) -> None:
    num_each = 20
    attacks = [asyncio.create_task(idle(gateway.url, "127.0.0.4")) for _ in range(num_each)]
    attacks += [asyncio.create_task(trickle(gateway.url, "127.0.0.5")) for _ in range(num_each)]
    await asyncio.sleep(0.5)  # all connected and trickling
    async with httpx.AsyncClient(timeout=5) as fresh:
        started = time.monotonic()
        health = await fresh.get(f"{gateway.url}/healthz")
        health_s = time.monotonic() - started
        started = time.monotonic()
        run = await fresh.post(
            f"{gateway.url}/client/v4/accounts/{gateway.account}/ai/run/{GLM}",
            headers={"authorization": f"Bearer {gateway.token}"},
            json={"prompt": "hi", "max_tokens": 8},
        )
        run_s = time.monotonic() - started
    results = await asyncio.gather(*attacks)
    print(
        f"tried {num_each} idle + {num_each} trickling connections; meanwhile /healthz {health.status_code} "
        f"in {health_s * 1000:.0f} ms, a run {run.status_code} in {run_s * 1000:.0f} ms"
    )
    for what, group in (("idle", results[:num_each]), ("trickling", results[num_each:])):
        statuses = sorted({_status(answer) for answer, _ in group})
        longest = max(elapsed for _, elapsed in group)
        print(f"  {what}: answered {statuses}, closed after at most {longest:.2f} s")
        assert longest < HEADER_TIMEOUT_S + 1.5
    assert all(answer == b"" for answer, _ in results[:num_each])  # idle: closed, nothing to answer
    assert all(_status(answer) == "HTTP/1.1 408 Request Timeout" for answer, _ in results[num_each:])
    assert _error(results[num_each][0]) == (3046, "AiError: Request headers not received in time.")
    assert health.status_code == 200 and health_s < 2.0
    assert run.status_code == 200 and run_s < 3.0, run.text


async def test_the_deadline_applies_again_after_each_response(gateway: Standalone) -> None:
    """A kept-alive connection serves its next request normally, but trickling that next request's
    head (or bare CRLFs, which start no request) is cut at the deadline like on a new connection."""
    reader, writer = await asyncio.open_connection(*_host_port(gateway.url))
    try:
        request = b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n"
        for _ in range(2):  # two requests on one connection, promptly: both answered
            writer.write(request)
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
            assert head.startswith(b"HTTP/1.1 200"), head
            await asyncio.wait_for(reader.readexactly(len(b'{"status":"ok"}')), 2)
        started = time.monotonic()
        answer = None
        while time.monotonic() - started < ATTACK_BOUND_S:
            writer.write(b"\r\n")  # no request ever begins
            await writer.drain()
            try:
                answer = await asyncio.wait_for(reader.read(65536), 0.2)
                break
            except TimeoutError:
                continue
        elapsed = time.monotonic() - started
    finally:
        writer.close()
    print(f"tried CRLFs every 0.2 s after two answered requests: {_status(answer)} after {elapsed:.2f} s")
    assert answer is not None and elapsed < HEADER_TIMEOUT_S + 1.5


async def test_connections_over_the_cap_are_refused_at_once(gateway: Standalone) -> None:
    num_attack = MAX_CONNECTIONS + 30  # from three clients, none over its own cap
    attacks = [asyncio.create_task(idle(gateway.url, f"127.0.0.{10 + i % 3}")) for i in range(num_attack)]
    results = await asyncio.gather(*attacks)
    refused = [elapsed for answer, elapsed in results if _status(answer).startswith("HTTP/1.1 503")]
    timed_out = [elapsed for answer, elapsed in results if answer == b""]
    print(
        f"tried {num_attack} idle connections at a cap of {MAX_CONNECTIONS}: {len(refused)} refused with 503 "
        f"(slowest {max(refused, default=0) * 1000:.0f} ms), {len(timed_out)} closed at the header deadline"
    )
    assert len(refused) + len(timed_out) == num_attack
    assert len(refused) >= num_attack - MAX_CONNECTIONS  # the test client's own pool may hold one more
    refusals = [answer for answer, _ in results if _status(answer).startswith("HTTP/1.1 503")]
    # past three quarters of the cap each of the three clients is over its crowded share: refused as
    # a client, then (the connections of other tests still closing) as the server
    as_client = (3040, "AiError: Too many open connections from this client, try again.")
    assert as_client in {_error(r) for r in refusals}
    assert {_error(r) for r in refusals} <= {
        (3040, "AiError: Too many open connections, try again."),
        as_client,
    }
    assert all(b"retry-after:" in r.lower() for r in refusals)
    assert max(refused) < 2.0
    async with httpx.AsyncClient(timeout=5) as fresh:
        assert (await fresh.get(f"{gateway.url}/healthz")).status_code == 200  # served again once they left


async def test_one_client_cannot_take_every_connection(gateway: Standalone) -> None:
    """A client holding connections open (half-sent heads, reconnecting as they are cut) gets at
    most its share: past it, 503 at once; another client is served meanwhile (a red-team helper's
    1,100 connections locked every other client out before)."""
    num_attack = MAX_PER_CLIENT + 15
    attacks = [asyncio.create_task(idle(gateway.url, "127.0.0.2")) for _ in range(num_attack)]
    await asyncio.sleep(0.5)  # all connected
    reader, writer = await asyncio.open_connection(*_host_port(gateway.url), local_addr=("127.0.0.3", 0))
    try:
        writer.write(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2)
    finally:
        writer.close()
    results = await asyncio.gather(*attacks)
    refused = [answer for answer, _ in results if _status(answer).startswith("HTTP/1.1 503")]
    print(
        f"tried {num_attack} idle connections from one client: {len(refused)} refused; another client: {head[:15]!r}"
    )
    assert head.startswith(b"HTTP/1.1 200")
    assert len(refused) == num_attack - MAX_PER_CLIENT
    assert _error(refused[0]) == (3040, "AiError: Too many open connections from this client, try again.")


async def test_two_clients_at_their_caps_leave_room_for_others(gateway: Standalone) -> None:
    """Two addresses each holding connections open up to their own cap (40 of 60) filled the server
    before; past three quarters of it (45) neither may open more while it holds an eighth (7), so a
    third client is served, and a fourth, with the attack still on."""
    per_attacker = MAX_PER_CLIENT
    attackers = ("127.0.0.4", "127.0.0.5")
    attacks = [asyncio.create_task(idle(gateway.url, a)) for _ in range(per_attacker) for a in attackers]
    await asyncio.sleep(0.5)  # all connected or refused
    heads = []
    for victim in ("127.0.0.6", "127.0.0.7"):
        reader, writer = await asyncio.open_connection(*_host_port(gateway.url), local_addr=(victim, 0))
        try:
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: localhost\r\n\r\n")
            heads.append(await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 2))
        finally:
            writer.close()
    results = await asyncio.gather(*attacks)
    refused = [answer for answer, _ in results if _status(answer).startswith("HTTP/1.1 503")]
    held = len(results) - len(refused)
    print(f"two clients tried {len(results)} idle connections: {held} held, {len(refused)} refused")
    assert all(head.startswith(b"HTTP/1.1 200") for head in heads)
    crowded_at = MAX_CONNECTIONS * 3 // 4
    assert held <= crowded_at and held < 2 * MAX_PER_CLIENT
    # as clients (the earlier tests' connections, closing at their header deadline, may fill the rest)
    assert (3040, "AiError: Too many open connections from this client, try again.") in {
        _error(r) for r in refused
    }


async def test_a_malformed_request_is_answered_in_the_error_envelope(gateway: Standalone) -> None:
    reader, writer = await asyncio.open_connection(*_host_port(gateway.url))
    try:
        writer.write(
            b"POST /healthz HTTP/1.1\r\nhost: localhost\r\ncontent-length: 99999999999999999999999\r\n\r\n"
        )
        answer = await _read_until_closed(reader, 5)
    finally:
        writer.close()
    assert _status(answer) == "HTTP/1.1 400 Bad Request"
    assert _error(answer) == (5006, "AiError: Invalid HTTP request received.")


async def test_oversized_headers_are_refused_early_with_bounded_memory(gateway: Standalone) -> None:
    pid = gateway.proc.pid
    async with httpx.AsyncClient(timeout=5) as fresh:
        normal = await fresh.get(f"{gateway.url}/healthz", headers={"cookie": "c" * 8192})
    assert normal.status_code == 200  # an 8 KiB header is fine
    before = rss_mib(pid)
    answer, elapsed = await big_header(gateway.url, 1024 * 1024)
    print(f"tried one 1 MiB header: {_status(answer)} after {elapsed * 1000:.0f} ms")
    assert _status(answer) == "HTTP/1.1 431 Request Header Fields Too Large" and elapsed < 2.0
    assert _error(answer) == (
        3006,
        "AiError: Request header fields too large.",
    )  # the API's envelope, before the app
    answer, _ = await big_header(gateway.url, 40 * 1024)  # whole head in one read: the exact count
    print(f"tried one 40 KiB header: {_status(answer)}")
    assert _status(answer) == "HTTP/1.1 431 Request Header Fields Too Large"
    num_concurrent, size = 6, 32 * 1024 * 1024
    results = await asyncio.gather(*(big_header(gateway.url, size) for _ in range(num_concurrent)))
    after = rss_mib(pid)
    statuses = sorted({_status(a) for a, _ in results})
    print(
        f"tried {num_concurrent} concurrent {size >> 20} MiB headers: {statuses}, slowest "
        f"{max(e for _, e in results):.2f} s; gateway RSS {before:.0f} -> {after:.0f} MiB"
    )
    assert statuses == ["HTTP/1.1 431 Request Header Fields Too Large"]
    assert after - before < 32  # a few socket reads per connection, not the 192 MiB sent
    async with httpx.AsyncClient(timeout=5) as fresh:
        assert (await fresh.get(f"{gateway.url}/healthz")).status_code == 200


def test_a_client_is_an_ipv4_address_or_an_ipv6_64() -> None:
    assert client_key(("10.0.0.1", 5)) == client_key(("::ffff:10.0.0.1", 5, 0, 0)) == "10.0.0.1"
    assert client_key(("2001:db8::1", 5, 0, 0)) == client_key(("2001:db8::ff:1", 6, 0, 0)) == "2001:db8::/64"
    assert client_key(("2001:db8:0:1::1", 5, 0, 0)) == "2001:db8:0:1::/64"
    assert client_key(("fe80::1%eth0", 5, 0, 2)) == "fe80::/64"
    assert client_key("/run/kumo.sock") is None and client_key(None) is None

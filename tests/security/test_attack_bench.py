"""`kumo bench attack`'s bounded subset against the fake-backed gateway: each attack runs, prints
what it tried and got, and holds; a victim request of another tenant succeeds during each.

`image_bomb` needs a real Kimi backend (its cap is the backend's; see
`test_image_cost.py`)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import socket

from gateway_harness import GLM, KIMI, Harness, _tenant

from benchmarks.attack import ATTACKS, Outcome, Target, _raw, goal_met, run
from benchmarks.cli import main as bench_main

CI_SUBSET = [
    "cross_tenant", "body_size", "nesting", "ssrf", "poll_flood", "batch_flood", "grammar_bomb",
    "vanishing_streams", "metrics", "big_header", "slowloris",
]  # fmt: skip


async def test_the_bounded_attacks_hold_and_the_victim_is_served(harness: Harness) -> None:
    victim_account, victim_token = await _tenant(harness.services, "attack-victim", "paid")
    target = Target(
        url=harness.url, account=harness.account, token=harness.token,
        victim_account=victim_account, victim_token=victim_token, model=GLM, vision_model=KIMI, quick=True,
    )  # fmt: skip
    # the gateway runs in this process: its RSS is recorded (not bounded: this process holds pytest too)
    unloaded, outcomes = await run(target, CI_SUBSET, {"gateway": os.getpid()})
    assert unloaded is not None
    assert [o.name for o in outcomes] == CI_SUBSET
    for o in outcomes:
        assert o.held, o
        assert o.victim_s is not None, o  # the victim's request succeeded during the attack
        assert o.seconds < 60, o  # bounded
        assert o.peak_rss_mb is not None and o.peak_rss_mb["gateway"] > 0, o


def test_the_command_names_its_attacks() -> None:
    assert set(CI_SUBSET) <= set(ATTACKS)
    try:
        bench_main(["attack", "--url", "http://127.0.0.1:9", "--account", "a", "--token", "t",
                    "--victim-account", "v", "--victim-token", "vt", "--only", "no_such_attack"])  # fmt: skip
    except SystemExit as exc:
        assert exc.code == 2
    else:
        raise AssertionError("an unknown attack must be a usage error")


def test_the_goal_bounds_the_victim_ratio_and_each_process_rss() -> None:
    def outcome(victim_s: float | None, **rss: float) -> Outcome:
        return Outcome("a", "tried", "got", True, 1.0, victim_s, rss or None)

    assert goal_met(outcome(0.2, gateway=511, glm=4095), unloaded=0.1)
    assert not goal_met(outcome(0.21, gateway=100), unloaded=0.1)  # past 2x the unloaded latency
    assert not goal_met(outcome(None), unloaded=0.1)  # the victim failed
    assert not goal_met(outcome(0.1, gateway=512), unloaded=0.1)  # the gateway's 512 MB
    assert not goal_met(outcome(0.1, gateway=100, glm=4096), unloaded=0.1)  # a backend's 4 GB
    assert not goal_met(outcome(0.1, gateway=float("nan")), unloaded=0.1)  # unreadable is not under
    assert not goal_met(Outcome("a", "tried", "got", False, 1.0, 0.1), unloaded=0.1)  # did not hold


async def test_a_raw_attack_closes_its_socket_even_when_the_server_stopped_reading() -> None:
    # A server that accepts and never reads: the attack's unsent megabytes stay in its transport's
    # buffer, and a plain `close()` keeps the socket open until they are written (never), to be found
    # unclosed by whichever later test collects it.
    accepted: list[asyncio.Transport] = []

    class Deaf(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            transport.pause_reading()
            accepted.append(transport)

    server = await asyncio.get_running_loop().create_server(Deaf, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    t = Target(url=f"http://127.0.0.1:{port}", account="a", token="t", victim_account="v",
               victim_token="vt", model="m", vision_model="m", quick=True)  # fmt: skip
    try:
        got = await _raw(t, b"GET / HTTP/1.1\r\nX-Big: " + b"a" * (32 << 20), timeout_s=0.5)
        assert got.startswith("no answer"), got
        for _ in range(3):
            await asyncio.sleep(0)
        assert _open_sockets_to(port) == []
    finally:
        for transport in accepted:
            transport.abort()
        server.close()
        await server.wait_closed()


def _open_sockets_to(port: int) -> list[socket.socket]:
    """This process's client sockets still open to `port`."""
    found = []
    for obj in gc.get_objects():
        if type(obj) is socket.socket and obj.family == socket.AF_INET and obj.fileno() != -1:
            with contextlib.suppress(OSError):
                if obj.getpeername()[1] == port:
                    found.append(obj)
    return found

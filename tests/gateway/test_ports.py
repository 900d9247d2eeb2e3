"""Ports held from the moment they are chosen (schemas/listen.py): `kumo serve`'s and each backend's,
the rank group's store, and what a port in use does.

The bug this guards against: ports chosen by binding port 0 and closing the socket again were bound
for real only seconds later, by another process (a backend after loading its model); meanwhile any
other pick could return the same port, and two backends of one `kumo serve --tp 2` got the same port
about once in five starts on two cores (2026-12-06)."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from backend.engine.ranks import rank_store
from backend.server.settings import BackendSettings
from gateway.serve import BackendProcess
from gateway.supervisor import Supervisor
from schemas.listen import bind, port_of

ROOT = Path(__file__).resolve().parents[2]


def _refused(port: int) -> bool:
    with socket.socket() as client:
        return client.connect_ex(("127.0.0.1", port)) == errno.ECONNREFUSED


def _is_held(port: int) -> bool:
    """The kernel's own picks (port 0: what every other process asking for a free port gets) skip a
    port that a socket holds, as a plain bind of it fails. (Two sockets with SO_REUSEADDR may both
    bind one port while neither listens: a port is only ever bound explicitly by whoever picked it.)"""
    with socket.socket() as other:
        try:
            other.bind(("127.0.0.1", port))
        except OSError as exc:
            return exc.errno == errno.EADDRINUSE
    return False


def test_a_bound_port_is_held_and_refuses_connections_until_it_listens() -> None:
    sockets = bind("127.0.0.1", 0)
    try:
        port = port_of(sockets)
        assert port > 0 and _is_held(port)  # no other process can get it meanwhile
        assert _refused(port)  # as before: nothing listens until the server does
        sockets[0].listen()
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        for sock in sockets:
            sock.close()


def test_a_backends_reserved_port_is_its_own_until_closed() -> None:
    b = BackendProcess("m", Path("."), "p", 0, "secret00")
    b.reserve_port()
    try:
        assert b.listener is not None and b.port == port_of([b.listener]) and b.url.endswith(f":{b.port}")
        assert _is_held(b.port)
    finally:
        b.close()
    assert b.listener is None and not _is_held(b.port)


def test_a_child_serves_on_the_socket_it_inherits() -> None:
    """What `kumo serve` does for each backend (`--listen-fd`): the parent binds, the child listens."""
    [sock] = bind("127.0.0.1", 0)
    port, fd = port_of([sock]), sock.fileno()
    script = (
        "import socket, sys\n"
        "from schemas.listen import inherit\n"
        f"s = inherit({fd})\n"
        "s.listen()\n"
        "print('listening', flush=True)\n"
        "c, _ = s.accept()\n"
        "c.sendall(b'hello')\n"
        "c.close()\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        pass_fds=(fd,),
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )
    sock.close()  # the child's copy is the one that serves
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "listening"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as client:
            assert client.recv(16) == b"hello"
        assert child.wait(10) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()


def test_the_rank_groups_store_is_bound_before_any_rank_is_started() -> None:
    settings = BackendSettings(model="m", port=1, secret="secret00", tp=2)
    store = rank_store(settings)  # rank 0's: no rank 1 yet (it would be given `store.port`)
    assert store.port > 0 and _is_held(store.port)
    follower = rank_store(settings, store.port)  # what rank 1 does
    follower.set("rank-1", "here")
    assert store.get("rank-1") == b"here"


def _serve(args: list[str], data_dir: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), KUMO_BACKEND_SECRET="secret00"),
    )


def test_serve_on_a_port_in_use_says_so_before_it_loads_anything(tmp_path: Path) -> None:
    [held] = bind("127.0.0.1", 0)
    held.listen()  # another server
    try:
        started = time.monotonic()
        done = _serve(["serve", "--port", str(port_of([held])), "--data-dir", str(tmp_path)], tmp_path)
        assert done.returncode == 2, done.stderr
        assert f"kumo serve: cannot listen on 127.0.0.1:{port_of([held])}" in done.stderr
        assert "--port" in done.stderr and "Traceback" not in done.stderr
        assert not (tmp_path / "checkpoints").exists()  # nothing converted, no backend started
        assert time.monotonic() - started < 30
    finally:
        held.close()


def test_a_backend_on_a_port_in_use_says_so_before_it_loads(tmp_path: Path) -> None:
    [held] = bind("127.0.0.1", 0)
    held.listen()  # another server
    try:
        done = _serve(
            ["backend", "--model", str(tmp_path / "none"), "--port", str(port_of([held]))], tmp_path
        )
        assert done.returncode == 1, done.stderr
        assert f"kumo backend: cannot listen on 127.0.0.1:{port_of([held])}" in done.stderr
        assert "Traceback" not in done.stderr
    finally:
        held.close()


class _Child:
    """A supervised process that exits at once."""

    def __init__(self) -> None:
        self.name = "m"
        self.process: asyncio.subprocess.Process | None = None
        self.started: list[asyncio.subprocess.Process] = []

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(sys.executable, "-c", "pass")
        self.started.append(self.process)


async def test_a_restart_that_cannot_bind_is_tried_again_after_the_next_backoff() -> None:
    child, attempts = _Child(), []
    await child.start()

    async def restart(c: object) -> None:
        attempts.append(time.monotonic())
        if len(attempts) == 1:  # the port was taken while the backend was down
            raise OSError(errno.EADDRINUSE, "Address already in use")
        await child.start()

    supervisor = Supervisor([child], restart, first_backoff_s=0.05, max_backoff_s=0.2)
    supervisor.start()
    try:
        for _ in range(200):
            if supervisor.num_restarts >= 2:
                break
            await asyncio.sleep(0.02)
    finally:
        await supervisor.stop()
        for process in child.started:
            await process.wait()
    assert supervisor.num_restarts >= 2  # the watcher lived through the failed start
    assert len(attempts) >= 3

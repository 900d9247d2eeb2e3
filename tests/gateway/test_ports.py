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

import pytest

from backend.engine.ranks import rank_store
from backend.server.settings import BackendSettings
from gateway.serve import BackendProcess
from gateway.supervisor import Supervisor
from schemas.listen import bind, in_use, listen, port_of

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
        assert port > 0 and _is_held(port)  # no other process's pick returns it meanwhile
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
        with pytest.raises(OSError) as taken:  # picked, not shared: not even a server's bind gets it
            bind("127.0.0.1", b.port)
        assert in_use(taken.value)
    finally:
        b.close()
    assert b.listener is None and not _is_held(b.port)


def test_a_served_port_can_be_bound_again_the_moment_its_server_is_gone() -> None:
    """What `kumo serve` does when a backend dies: bind its port again at once (held through the
    backoff), past the TIME_WAIT entries of the connections the dead backend had closed."""
    b = BackendProcess("m", Path("."), "p", 0, "secret00")
    b.reserve_port()  # picked: bound without SO_REUSEADDR
    server, b.listener = b.listener, None
    assert server is not None
    listen([server], 8)  # as the backend does before serving
    with socket.create_connection(("127.0.0.1", b.port), timeout=5) as client:
        accepted, _ = server.accept()
        accepted.close()  # the server closes first: its side of the connection waits in TIME_WAIT
        assert client.recv(1) == b""
    server.close()  # the backend is gone
    try:
        b.reserve_port(b.port)
        assert b.listener is not None and _is_held(b.port)
    finally:
        b.close()


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


def test_a_rank_that_comes_later_than_the_collective_timeout_still_joins() -> None:
    """Rank 0 is at the meeting first (the others start after it, and import torch before they
    come): that wait is the start-up's, not `--rank-timeout-s` (1 s here; rank 1 comes after 4 s)."""
    script = (
        "import sys, time\n"
        "import torch, torch.distributed as dist\n"
        "from backend.engine.ranks import join_group, rank_store\n"
        "from backend.server.settings import BackendSettings\n"
        "rank, port = int(sys.argv[1]), int(sys.argv[2])\n"
        "settings = BackendSettings(model='m', port=1, secret='secret00', tp=2, rank_timeout_s=1.0)\n"
        "if rank == 0:\n"
        "    store = rank_store(settings)\n"
        "    print(store.port, flush=True)\n"
        "else:\n"
        "    time.sleep(4)\n"
        "    store = rank_store(settings, port)\n"
        "join_group(settings, rank, store)\n"
        "t = torch.tensor([rank + 1.0])\n"
        "dist.all_reduce(t)\n"
        "print('sum', int(t.item()), flush=True)\n"
        "dist.destroy_process_group()\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-c", script]
    rank0 = subprocess.Popen(
        [*command, "0", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env
    )
    try:
        assert rank0.stdout is not None
        port = rank0.stdout.readline().strip()
        assert port.isdigit(), rank0.communicate(timeout=30)
        rank1 = subprocess.run([*command, "1", port], capture_output=True, text=True, env=env, timeout=60)
        out, err = rank0.communicate(timeout=60)
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.communicate()
    assert rank0.returncode == 0 and rank1.returncode == 0, (err, rank1.stderr)
    assert out.strip() == "sum 3" and rank1.stdout.strip() == "sum 3"


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
        assert 'make serve ARGS="--port N"' in done.stderr  # the README starts it with make
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
        self.process = await asyncio.create_subprocess_exec(sys.executable, "-I", "-S", "-c", "pass")
        self.started.append(self.process)


async def test_a_restart_that_cannot_bind_is_tried_again_after_the_next_backoff() -> None:
    child, events = _Child(), []
    await child.start()

    def on_exit(c: object) -> None:
        events.append("exit")
        if events.count("exit") == 1:  # (`kumo serve` binds the port again here: it may fail too)
            raise OSError(errno.EADDRINUSE, "Address already in use")

    async def restart(c: object) -> None:
        events.append("start")
        if events.count("start") == 1:  # the port was taken while the backend was down
            raise OSError(errno.EADDRINUSE, "Address already in use")
        await child.start()

    supervisor = Supervisor([child], restart, on_exit=on_exit, first_backoff_s=0.05, max_backoff_s=0.2)
    supervisor.start()
    try:
        deadline = time.monotonic() + 30  # (a loaded CI machine starts a process in seconds)
        while supervisor.num_restarts < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    finally:
        await supervisor.stop()
        for process in child.started:
            await process.wait()
    assert supervisor.num_restarts >= 2  # the watcher lived through the failed hook and start
    # each exit seen once, at once; the failed start tried again without a second "exit"
    assert events[:5] == ["exit", "start", "start", "exit", "start"]


def _resolves_to(monkeypatch: pytest.MonkeyPatch, *hosts: str) -> None:
    """`getaddrinfo` answering with these IPv4 addresses, in this order (as `localhost` gives ::1 and
    127.0.0.1)."""

    def getaddrinfo(host: object, port: int, *args: object, **kwargs: object) -> list[tuple]:
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (h, port)) for h in hosts]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


def test_an_address_this_machine_lacks_is_skipped_while_another_binds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`--host localhost` where IPv6 is turned off (::1 cannot be bound): served on 127.0.0.1, not an
    error. 192.0.2.1 (TEST-NET-1) is no address of this machine, as ::1 is none of such a one."""
    _resolves_to(monkeypatch, "192.0.2.1", "127.0.0.1")
    sockets = bind("localhost", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1"]
    finally:
        for sock in sockets:
            sock.close()
    _resolves_to(monkeypatch, "192.0.2.1")  # none bindable: the kernel's error, not an empty list
    with pytest.raises(OSError) as none:
        bind("nowhere", 0)
    assert none.value.errno == errno.EADDRNOTAVAIL


def test_port_0_gives_every_address_of_a_host_the_same_port(monkeypatch: pytest.MonkeyPatch) -> None:
    """What `--port 0` announces is one URL: a host of two addresses is served on one port."""
    _resolves_to(monkeypatch, "127.0.0.1", "127.0.0.2")
    sockets = bind("two", 0)
    try:
        assert [s.getsockname()[0] for s in sockets] == ["127.0.0.1", "127.0.0.2"]
        assert len({s.getsockname()[1] for s in sockets}) == 1
    finally:
        for sock in sockets:
            sock.close()


def test_port_0_picks_again_where_another_address_has_the_pick_in_use(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The kernel picks port 0 for the first address alone: where the second has that port in use,
    `bind` picks again rather than fail (review of 692bfa8: 41 failures in 200 with 3,000 ports held)."""
    _resolves_to(monkeypatch, "127.0.0.1", "127.0.0.2")
    real_bind, taken = socket.socket.bind, []

    def bind_once_taken(sock: socket.socket, address: tuple) -> None:
        if address[0] == "127.0.0.2" and not taken:  # the first pick: in use on the second address
            taken.append(address[1])
            raise OSError(errno.EADDRINUSE, "Address already in use")
        real_bind(sock, address)

    monkeypatch.setattr(socket.socket, "bind", bind_once_taken)
    sockets = bind("two", 0)
    try:
        assert len(taken) == 1 and len({s.getsockname()[1] for s in sockets}) == 1 and len(sockets) == 2
    finally:
        for sock in sockets:
            sock.close()

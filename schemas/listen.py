"""Ports held from the moment they are chosen: the gateway's, and each backend's.

Choosing a free port by binding port 0 and closing the socket again (and binding it later, in
another process) leaves a window in which any other process may take it: `kumo serve --tp 2` on
two CPU cores gave two backends the same port about once in five starts (2026-12-06; its four
backends each loading for seconds before they bound, besides their ranks' stores). So the port is
bound when it is chosen and the bound socket itself is what serves: `bind` binds without listening
(a connection is refused until the server listens, as before it had bound), the uvicorn server takes
the sockets (`uvicorn.Server.serve(sockets=...)`), and a child process inherits its socket
(`inherit`) instead of being told a number. A server's `listen` can still fail (`in_use`) where
another process bound the same port with SO_REUSEADDR before either listened. Standard library
only: the gateway and the backend both use it.
"""

from __future__ import annotations

import errno
import socket
from typing import Any

PICK_TRIES = 16  # port 0 on a host of several addresses: picks tried until one is free on all of them


def bind(host: str, port: int, *, reuse_address: bool = True) -> list[socket.socket]:
    """One socket bound to `port` for each address `host` resolves to (as asyncio's `create_server`
    binds them: IPv6 sockets IPv6-only, a family this kernel lacks skipped; host "": every
    interface), not yet listening. Port 0: the kernel picks one for the first address and the
    others take the same (picked again where another address has it in use). An address this
    machine cannot bind (`localhost`'s ::1 where IPv6 is turned off) is skipped while another binds.

    Held: the kernel's own picks (port 0, what any other process asking for a free port gets) skip
    a bound port. `reuse_address` (SO_REUSEADDR, what a server sets to bind a port its last run left
    connections in TIME_WAIT on) lets another such socket bind the same port too, until one listens:
    leave it off for a port just picked, which no earlier run used. OSError (the port in use, an
    unknown host) with none left open."""
    infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    addresses = list(dict.fromkeys(infos))  # (getaddrinfo may repeat one)
    for attempt in range(PICK_TRIES):
        try:
            return _bind_all(addresses, host, port, reuse_address)
        except _PickTaken:
            if attempt == PICK_TRIES - 1:
                raise OSError(errno.EADDRINUSE, f"no port free on every address of {host!r}") from None
    raise AssertionError("unreachable")


class _PickTaken(Exception):
    """Port 0: the port picked for the first address is in use on another."""


def _bind_all(
    addresses: list[tuple[Any, ...]], host: str, port: int, reuse_address: bool
) -> list[socket.socket]:
    bound: list[socket.socket] = []
    unavailable: OSError | None = None
    try:
        for family, kind, proto, _, address in addresses:
            try:
                sock = socket.socket(family, kind, proto)
            except OSError:  # a family this kernel was built without
                continue
            is_picked = bool(bound) and port == 0
            if is_picked:  # the port the first one got
                address = (address[0], port_of(bound), *address[2:])
            try:
                if reuse_address:
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(address)
            except OSError as exc:
                sock.close()
                if is_picked and in_use(exc):
                    raise _PickTaken from exc
                if exc.errno != errno.EADDRNOTAVAIL:
                    raise
                unavailable = exc
                continue
            bound.append(sock)
        if not bound:
            raise unavailable or OSError(f"no address of {host!r} can be bound on this machine")
    except (OSError, _PickTaken):
        for sock in bound:
            sock.close()
        raise
    return bound


def in_use(exc: OSError) -> bool:
    return exc.errno == errno.EADDRINUSE


def listen(sockets: list[socket.socket], backlog: int) -> None:
    """Start listening (before the server takes the sockets: a failure here is the caller's clear
    error, not one inside the server's start-up), with SO_REUSEADDR from now on: the connections a
    socket accepts inherit it, and so do the TIME_WAIT entries they leave, which is what lets the
    next run bind the port again at once (a port picked without it: a restart failed for a minute)."""
    for sock in sockets:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.listen(backlog)


def port_of(sockets: list[socket.socket]) -> int:
    return int(sockets[0].getsockname()[1])


def inherit(fd: int) -> socket.socket:
    """The socket a parent passed as descriptor `fd` (`subprocess`'s `pass_fds`), not passed on to
    this process's own children."""
    sock = socket.socket(fileno=fd)
    sock.set_inheritable(False)
    return sock

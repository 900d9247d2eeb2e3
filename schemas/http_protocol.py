"""The HTTP/1.1 connection protocol of the gateway's and the backend's uvicorn servers: uvicorn's
httptools protocol plus three limits that hold before any application code, authentication
included, sees a request. (Here, in the package both sides share, so the backend never imports the
gateway; the one module of `schemas/` that is not Structs, it leans on uvicorn, as both servers do.)

- **Header deadline.** A request's line and headers must be complete `header_timeout_s` after the
  connection opened, or after the first byte following the previous response. Otherwise the
  connection is closed (with a 408 when part of a request had arrived): a client that trickles
  its headers (slowloris) or connects and sends nothing holds a connection at most that long.
  Once a response has been sent, uvicorn's keep-alive timeout closes a connection left idle.
- **Header size.** More than `max_header_bytes` of request line and headers is refused with 431.
  Bytes are counted as they arrive, so a huge header costs at most the limit plus one socket read
  of memory, never the header's size (httptools itself has no limit).
- **Connection cap.** A connection that would make more than `max_connections` open ones is
  answered 503 and closed at once, so its descriptor is freed immediately; so is one that would
  give its client (an IPv4 address, an IPv6 /64) more than `max_connections_per_client`: one
  client holding connections open without a request could otherwise lock every other one out
  for as long as it reconnects (a red-team helper's 1,100 half-sent heads did, session 24).
  Past three quarters of `max_connections` (`crowded_at`) a client may open more only while it
  holds fewer than an eighth of them (`crowded_share`): the last quarter is kept for clients with
  few connections, so that two addresses at their cap (half each) no longer fill the server; a
  client with many connections is served as before while there is room.
- **Malformed requests** (what the parser refuses) get the same written answer, a 400.

Why not uvicorn's `limit_concurrency`: it refuses *requests* (a 503 once a request's headers are in)
while connections or tasks are over the limit, and never the connections themselves. Connections
that send nothing are never refused, so they pile up until descriptors run out (the attack this
module answers), and while they are there every request on every other connection gets 503. The
cap here acts when a connection is accepted, and the header deadline empties idle ones.

The answers are plain text unless the server says how to write them (`ServerConfig.refusal`: the
gateway answers in the API's error envelope). A 408 or 431 is written, the sending side is shut (FIN), and whatever the client still sends is
read and dropped for up to `LINGER_S` before the socket closes: closing with unread data would send
an RST that can destroy the answer before the client reads it.
"""

from __future__ import annotations

import asyncio
import ipaddress
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

LINGER_S = 2.0  # after a refusal: how long the client's remaining bytes are read and dropped


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = 10.0
    max_header_bytes: int = 32 * 1024  # request line + headers (Cloudflare's own limit is 32 KB)
    max_connections: int = 1024
    max_connections_per_client: int = 512  # (0: no per-client cap, as behind a proxy that is one client)

    @property
    def crowded_at(self) -> int:
        """Open connections past which a client holding `crowded_share` or more may open no more."""
        return self.max_connections * 3 // 4

    @property
    def crowded_share(self) -> int:
        return max(1, self.max_connections // 8)


# a limit's answer: (status, message) -> (headers but content-length, body)
Refusal = Callable[[HTTPStatus, str], tuple[list[tuple[bytes, bytes]], bytes]]


def plain_refusal(status: HTTPStatus, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    return [(b"content-type", b"text/plain; charset=utf-8")], message.encode()


class ServerConfig(uvicorn.Config):
    """uvicorn's configuration serving HTTP/1.1 through `GuardedHttpProtocol` with `limits`;
    `refusal` writes the limits' answers."""

    def __init__(
        self, app: Any, limits: ConnectionLimits, *, refusal: Refusal = plain_refusal, **kwargs: Any
    ) -> None:
        super().__init__(app, http=GuardedHttpProtocol, **kwargs)
        self.limits = limits
        self.refusal = refusal
        self.connections_by_client: Counter[str] = Counter()  # open connections by `client_key`


def client_key(peer: object) -> str | None:
    """The client a peer address (`peername`) counts against: its IPv4 address (an IPv4-mapped
    IPv6 one's too), or its IPv6 /64, which one host commonly holds whole; None for a Unix socket."""
    if not isinstance(peer, tuple) or not peer or not isinstance(peer[0], str):
        return None
    try:
        address = ipaddress.ip_address(peer[0].split("%")[0])
    except ValueError:
        return None
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


class _HeadTooLarge(Exception):
    """Raised inside the parser's callback to stop it after the refusal is written."""


class GuardedHttpProtocol(HttpToolsProtocol):
    """One client connection; see the module docstring for the limits."""

    def __init__(
        self,
        config: uvicorn.Config,
        server_state: ServerState,
        app_state: dict[str, Any],
        _loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        super().__init__(config, server_state, app_state, _loop)
        assert isinstance(config, ServerConfig)
        self.limits = config.limits
        self._refusal = config.refusal
        self._by_client = config.connections_by_client
        self._client_key: str | None = None  # set while this connection counts against its client
        self._head_deadline: asyncio.TimerHandle | None = None  # set while a request head is awaited
        self._num_head_bytes = 0  # bytes received since the awaited head began
        self._is_refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        # closed at once, not lingering: a flood of refused connections must not hold descriptors
        if len(self.connections) > self.limits.max_connections:
            self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, "Too many open connections, try again.", linger_s=0)
            return
        key = client_key(transport.get_extra_info("peername"))
        per_client = self.limits.max_connections_per_client
        if key is not None and per_client > 0:
            held, limits = self._by_client[key], self.limits
            if held >= per_client or (
                held >= limits.crowded_share and len(self.connections) > limits.crowded_at
            ):
                message = "Too many open connections from this client, try again."
                self._refuse(HTTPStatus.SERVICE_UNAVAILABLE, message, linger_s=0)
                return
            self._by_client[key] += 1
            self._client_key = key
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        if self._client_key is not None:
            self._by_client[self._client_key] -= 1
            if self._by_client[self._client_key] <= 0:
                del self._by_client[self._client_key]
            self._client_key = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._is_refused:
            return  # lingering after a refusal: drop what the client still sends
        if self._head_deadline is None and (self.cycle is None or self.cycle.response_complete):
            self._await_head()  # the first bytes after a response start the next head's deadline
        if self._head_deadline is not None:
            self._num_head_bytes += len(data)  # may include the tail of a previous body: errs safe
        super().data_received(data)
        if self._head_deadline is not None and self._num_head_bytes > self.limits.max_header_bytes:
            self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Request header fields too large.")

    def on_headers_complete(self) -> None:
        # the head ended inside the last read: count it exactly (the per-read count may not have tripped)
        size = len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.limits.max_header_bytes:
            self._refuse(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, "Request header fields too large.")
            raise _HeadTooLarge  # stops the parser; uvicorn's parser-error answer is skipped below
        self._stop_waiting()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        if self._is_refused:
            return  # already answered by a limit
        self._refuse(HTTPStatus.BAD_REQUEST, msg)  # the parser's refusal, written as the limits' are

    # ---- limits -------------------------------------------------------------------------------------
    def _await_head(self) -> None:
        self._num_head_bytes = 0
        self._head_deadline = self.loop.call_later(self.limits.header_timeout_s, self._head_timed_out)

    def _stop_waiting(self) -> None:
        if self._head_deadline is not None:
            self._head_deadline.cancel()
            self._head_deadline = None

    def _head_timed_out(self) -> None:
        self._head_deadline = None
        if self.transport.is_closing():
            return
        if self._num_head_bytes == 0:
            self.transport.close()  # an idle connection: nothing to answer
            return
        self._refuse(HTTPStatus.REQUEST_TIMEOUT, "Request headers not received in time.")

    def _refuse(self, status: HTTPStatus, message: str, linger_s: float = LINGER_S) -> None:
        """Answer `status` and close: FIN after the answer, then the client's further bytes are
        dropped until it closes too (uvicorn's `eof_received` lets the transport close) or for
        `linger_s`."""
        self._stop_waiting()
        self._is_refused = True
        headers, body = self._refusal(status, message)
        head = b"".join(b"%s: %s\r\n" % (name, value) for name, value in headers)
        self.transport.write(
            b"HTTP/1.1 %d %s\r\n%scontent-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status.value, status.phrase.encode(), head, len(body), body)
        )
        if linger_s <= 0:
            self.transport.close()
            return
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(linger_s, self.transport.close)

"""A gateway process's lifecycle: draining on SIGTERM and the per-request wall-clock limit.

SIGTERM (or the first Ctrl-C) starts a drain. uvicorn stops accepting connections and closes idle
ones; a request that still arrives on an open connection is refused with 503/3040 and
`Retry-After` (`DrainGate`); requests already accepted run on until the drain deadline, and any
still running then is ended with the 3008 abort error: a JSON answer, or an error frame on a
stream. Nothing accepted is dropped without an answer.

A request's wall-clock limit (`request_timeout_s`: the configured one, or less with
`cf-aig-request-timeout`) runs from the moment its handler starts, and every wait of the request is
bounded by `min(request deadline, drain deadline)` (`Lifecycle.bounded`): reading the body,
fetching image URLs, routing to a replica and each of the backend's events (`Lifecycle.guard`
wraps the router's event stream). Past the request deadline the wait ends with the timeout error
(408/3046), past the drain deadline with the abort error; a wait whose deadline has already passed
is not begun. Leaving the wrapped stream closes the backend connection, which aborts the request in
the engine. Admission is not cut (a reservation cut half-way could not be settled): a deadline that
passes during it ends the next wait.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import signal
import socket
from collections.abc import AsyncGenerator, AsyncIterator, Mapping
from types import FrameType
from typing import TypeVar

import anyio
import msgspec
import structlog
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send

from gateway.errors import Aborted, Timeout, Unavailable, retry_headers
from schemas.workers_ai import Envelope, ErrorItem

T = TypeVar("T")
log = structlog.get_logger("kumo.lifecycle")
REQUEST_TIMEOUT_HEADER = "cf-aig-request-timeout"  # milliseconds (AI Gateway's per-request knob)
ABORT_GRACE_S = 5.0  # after the drain deadline: time for aborted requests to send their answers


class Lifecycle:
    """Drain state of one gateway process; one per `Services`."""

    def __init__(self) -> None:
        self.is_draining = False
        self._abort_at: float | None = None  # loop time at which running requests are aborted
        self._waits: set[anyio.CancelScope] = set()

    def begin_drain(self, timeout_s: float) -> None:
        """Refuse new requests from now on; abort those still running after `timeout_s`."""
        if self.is_draining:
            return
        self.is_draining = True
        self._abort_at = asyncio.get_running_loop().time() + timeout_s
        log.info("drain_started", deadline_s=timeout_s, num_waiting=len(self._waits))
        for wait in self._waits:
            wait.deadline = min(wait.deadline, self._abort_at)

    async def guard(self, events: AsyncGenerator[T, None], deadline: float) -> AsyncGenerator[T, None]:
        """`events`, ended with `Timeout` at `deadline` (loop time) or with `Aborted` at the drain
        deadline."""
        async with contextlib.aclosing(events):
            while True:
                try:
                    async with self.bounded(deadline):
                        item = await anext(events)
                except StopAsyncIteration:
                    return
                yield item

    @contextlib.asynccontextmanager
    async def bounded(self, deadline: float | None = None) -> AsyncIterator[None]:
        """A wait (the body, an image fetch, a backend's next event) ended with `Timeout` at
        `deadline` (loop time; None: none) or with `Aborted` at the drain deadline, also one set
        while it waits; not begun at all when one of them has passed already."""
        loop = asyncio.get_running_loop()
        when = deadline if self._abort_at is None else min(deadline or self._abort_at, self._abort_at)
        if when is not None and when <= loop.time():
            raise self._expired(loop.time())
        # anyio's scope, not `asyncio.timeout`: what the wait runs (httpx closing a pool's connections)
        # shields its cleanup from anyio's cancellation only (encode/httpcore#830); anyio's clock on
        # asyncio is the loop's
        scope = anyio.CancelScope(deadline=math.inf if when is None else when)
        self._waits.add(scope)
        try:
            with scope:
                yield
        finally:
            self._waits.discard(scope)
        if scope.cancelled_caught:
            raise self._expired(loop.time())

    def _expired(self, now: float) -> Aborted | Timeout:
        if self._abort_at is not None and now >= self._abort_at:
            return Aborted("Request was aborted")
        return Timeout("Request timeout")


def request_deadline(headers: Mapping[str, str], limit_s: float) -> float:
    """The loop time at which a request starting now runs out (`request_timeout_s`)."""
    return asyncio.get_running_loop().time() + request_timeout_s(headers, limit_s)


def request_timeout_s(headers: Mapping[str, str], limit_s: float) -> float:
    """The wall-clock limit of one request: the configured one, or less when the caller asks for
    less with `cf-aig-request-timeout` (ms). A malformed header is ignored: anything but ASCII
    digits (`str.isdigit` takes '²', which `int` refuses), or more of them than any limit needs."""
    value = headers.get(REQUEST_TIMEOUT_HEADER, "")
    if value.isascii() and value.isdigit() and len(value) <= 12 and int(value) > 0:
        return min(limit_s, int(value) / 1000)
    return limit_s


class DrainGate:
    """ASGI middleware: while draining, every new HTTP request is answered 503/3040 at once."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle) -> None:
        self.app = app
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.lifecycle.is_draining:
            await self.app(scope, receive, send)
            return
        error = Unavailable("Server is shutting down, please try again.", retry_after=1)
        body = msgspec.json.encode(
            Envelope(
                result=None, success=False, errors=[ErrorItem(code=error.code, message=error.wire_message)]
            )
        )
        headers = [(k.encode(), v.encode()) for k, v in retry_headers(error).items()]
        headers += [(b"content-type", b"application/json"), (b"connection", b"close")]
        await send({"type": "http.response.start", "status": error.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM/SIGINT starts the app's drain. uvicorn itself closes
    the listening sockets and waits for open requests up to `timeout_graceful_shutdown`, which
    `gateway.server.uvicorn_config` sets past the drain deadline."""

    def __init__(self, config: uvicorn.Config, lifecycle: Lifecycle, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.lifecycle = lifecycle
        self.drain_timeout_s = drain_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        super().handle_exit(sig, frame)
        # a signal handler may run in the middle of the loop's own code: hand over, never touch it
        if self._loop is not None and sig in (signal.SIGTERM, signal.SIGINT):
            self._loop.call_soon_threadsafe(self.lifecycle.begin_drain, self.drain_timeout_s)

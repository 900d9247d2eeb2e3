"""`wrangler-mock dev`'s HTTP side: a Starlette app that hands every request to the Worker
(re-imported first if its files changed).

The app owns one httpx client for the Worker's `env.AI` for its whole life (lifespan), builds a
`Request` per incoming request, and turns the Worker's `Response` back into an ASGI response,
streaming it when the body is a stream (e.g. SSE passed through from `env.AI.run`).
"""

from __future__ import annotations

import asyncio
import socket
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request as StarletteRequest
from starlette.responses import PlainTextResponse, StreamingResponse
from starlette.responses import Response as StarletteResponse
from starlette.routing import Route

from wrangler_mock.ai_binding import Ai
from wrangler_mock.api import CloudflareApi
from wrangler_mock.config import WranglerConfig
from wrangler_mock.errors import ConfigError
from wrangler_mock.jsvalue import ReadableStream
from wrangler_mock.request import Request
from wrangler_mock.response import Response
from wrangler_mock.settings import Credentials
from wrangler_mock.worker import Env, ExecutionContext, LiveWorker

ALL_METHODS = ["GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"]


def to_asgi(response: Response) -> StarletteResponse:
    body = response.body
    if isinstance(body, ReadableStream):
        return StreamingResponse(body, status_code=response.status, headers=response.headers)
    return StarletteResponse(body or b"", status_code=response.status, headers=response.headers)


def build_app(
    config: WranglerConfig,
    credentials: Credentials,
    *,
    transport: httpx.AsyncBaseTransport | None = None,
) -> Starlette:
    """The Worker named by `config`, served; `transport` lets tests put a gateway in-process."""
    live = LiveWorker.load(config.main)
    state: dict[str, Any] = {}

    @asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        async with CloudflareApi.make_client(transport) as client:
            api = CloudflareApi(credentials.with_account_fallback(config.account_id), client)
            bindings = {config.ai_binding: Ai(api)} if config.ai_binding else {}
            state["env"] = Env.build(config.vars, bindings)
            state["ctx"] = ctx = ExecutionContext()
            yield
            await ctx.drain()

    async def endpoint(request: StarletteRequest) -> StarletteResponse:
        worker_request = Request(request.method, str(request.url), request.headers.items(), request.body)
        try:
            response = await live.current().fetch(worker_request, state["env"], state["ctx"])
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            return PlainTextResponse(f"Error: {type(exc).__name__}: {exc}\n", status_code=500)
        return to_asgi(response)

    routes = [Route("/", endpoint, methods=ALL_METHODS), Route("/{path:path}", endpoint, methods=ALL_METHODS)]
    return Starlette(routes=routes, lifespan=lifespan)


def listen(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a one-line error, not a traceback."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except OSError as exc:
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


async def serve(app: Starlette, host: str, port: int, *, banner: str = "") -> None:
    """Run `app` with uvicorn and print wrangler's "Ready on <url>" once the socket listens."""
    sock = listen(host, port)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    while not server.started and not task.done():
        await asyncio.sleep(0.02)
    if server.started:
        print(f"{banner}Ready on http://{host}:{sock.getsockname()[1]}", flush=True)
    await task

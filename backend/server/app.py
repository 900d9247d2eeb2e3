"""`kumo backend`: one checkpoint served over the internal protocol (DESIGN.md §3), uvicorn + Starlette.

Routes: `POST /v1/generate` (NDJSON events), `GET /v1/load`, `GET /v1/model`, `GET /v1/health`,
`GET /metrics`. Every route but health needs `Authorization: Bearer <secret>`. The engine steps on
its own thread (`AsyncEngine`), so the event loop only moves bytes. A request's failure is its own:
it becomes a 4xx/5xx answer or an error event, and the process keeps serving.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

import anyio
import msgspec
import torch
import torch.distributed as dist
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import Lifespan, Receive, Scope, Send

from backend.engine import heap
from backend.engine.async_engine import AsyncEngine
from backend.engine.ranks import join_group, rank_device, rank_store
from backend.errors import Aborted, EngineError, InvalidRequest, RanksDown, Unauthorized
from backend.models.image_encoder import MEDIA_PAD, ImageBudget, VisionEncoder
from backend.server.generation import Serving
from backend.server.metrics import BackendMetrics
from backend.server.model_card import ServedModel
from backend.server.rank_group import RankFailure, RankGroup, build_engine
from backend.server.settings import BackendSettings, build_settings
from backend.server.warmup import warm_up
from schemas.backend import ErrorBody, Event, GenerateRequest, Health, ModelCard
from schemas.http_protocol import ConnectionLimits, ServerConfig
from schemas.listen import bind, inherit, listen

log = logging.getLogger("kumo.backend")
_decode_request = msgspec.json.Decoder(GenerateRequest).decode
_encoder = msgspec.json.Encoder()
BACKEND_MAX_CONNECTIONS = 8192  # each gateway pools up to 1,000 connections to a replica


def _json(payload: msgspec.Struct, status: int = 200) -> Response:
    return Response(_encoder.encode(payload), status_code=status, media_type="application/json")


def _error(exc: EngineError) -> Response:
    return _json(ErrorBody(error=exc.to_event()), exc.status)


class NDJSONStream:
    """Streams events as NDJSON and stops as soon as the client goes: a disconnect (or a failed send)
    closes the event iterator, which aborts the request in the engine within one step."""

    def __init__(self, first: Event, rest: AsyncGenerator[Event, None], metrics: BackendMetrics) -> None:
        self._first, self._rest, self._metrics = first, rest, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"application/x-ndjson"), (b"cache-control", b"no-store")],
            }
        )
        async with aclosing(self._rest), anyio.create_task_group() as group:

            async def watch_disconnect() -> None:
                while (await receive())["type"] != "http.disconnect":
                    pass
                self._metrics.disconnects.inc()
                group.cancel_scope.cancel()

            group.start_soon(watch_disconnect)
            try:
                await self._send(send, self._first)
                async for event in self._rest:
                    await self._send(send, event)
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            except OSError:
                self._metrics.disconnects.inc()
            except Exception as exc:  # a bug in one request ends that stream with an error, nothing else
                log.exception("a generate stream failed")
                await self._send(send, EngineError(f"internal error: {exc!r}").to_event())
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            group.cancel_scope.cancel()

    async def _send(self, send: Send, event: Event) -> None:
        self._metrics.observe(event)
        await send({"type": "http.response.body", "body": _encoder.encode(event) + b"\n", "more_body": True})


@dataclass(slots=True)
class Backend:
    """The app's state, owned by the app (no module globals)."""

    serving: Serving
    card: ModelCard
    secret: str
    metrics: BackendMetrics
    is_ready: bool = True

    def _authorize(self, request: Request) -> None:
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.encode(), self.secret.encode()):
            raise Unauthorized("Missing or wrong backend secret.")

    async def generate(self, request: Request) -> Response | NDJSONStream:
        body: GenerateRequest | None = None
        try:
            self._authorize(request)
            try:
                body = _decode_request(await request.body())
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:
                raise InvalidRequest(str(exc)) from exc
            # template, tokens, grammar and images take CPU time: keep them off the event loop
            prepared = await anyio.to_thread.run_sync(self.serving.prepare, body)
            events = self.serving.events(prepared)
            first = await self._first_event(request, events)
            if first is None:  # the client left while the prompt was being prefilled
                self.metrics.disconnects.inc()
                return _error(Aborted("The client closed the connection."))
        except EngineError as exc:
            self.metrics.refused(exc.code)
            return _error(exc)
        except StopAsyncIteration:
            return _error(EngineError("The engine ended the request without an event."))
        except Exception as exc:  # a bug in one request must not take the process down
            log.exception("generate %s failed before its first event", body.request_id if body else "?")
            self.metrics.refused("internal")
            return _error(EngineError(f"internal error: {exc!r}"))
        self.metrics.requests.labels(outcome="accepted").inc()
        return NDJSONStream(first, events, self.metrics)

    async def _first_event(self, request: Request, events: AsyncGenerator[Event, None]) -> Event | None:
        """The first event, or None if the client disconnects first (prefill can take many steps; the
        request is aborted then, not when its first token would have been sent)."""

        async def next_event() -> Event:
            return await anext(events)

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        first, gone = asyncio.ensure_future(next_event()), asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not first.done():
                first.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await first
        if first.cancelled():
            await events.aclose()  # aborts the request in the engine
            return None
        return first.result()  # or raises the engine's refusal

    async def load(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except EngineError as exc:
            return _error(exc)
        return _json(self.serving.engine.load())

    async def model(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except EngineError as exc:
            return _error(exc)
        return _json(self.card)

    async def health(self, request: Request) -> Response:
        if not getattr(self.serving.engine, "is_alive", True):
            return _json(Health(status="failed"))
        return _json(Health(status="ok" if self.is_ready else "starting"))

    async def prometheus(self, request: Request) -> Response:
        try:
            self._authorize(request)
        except EngineError as exc:
            return _error(exc)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)


def create_app(backend: Backend, *, lifespan: Lifespan[Starlette] | None = None) -> Starlette:
    """The Starlette app over a `Backend`; `lifespan` starts and stops what it needs (the engine)."""
    routes = [
        Route("/v1/generate", backend.generate, methods=["POST"]),
        Route("/v1/load", backend.load, methods=["GET"]),
        Route("/v1/model", backend.model, methods=["GET"]),
        Route("/v1/health", backend.health, methods=["GET"]),
        Route("/metrics", backend.prometheus, methods=["GET"]),
    ]
    return Starlette(routes=routes, lifespan=lifespan)


def build_backend(
    settings: BackendSettings,
    *,
    on_rank_failure: Callable[[str], None] | None = None,
    store: dist.Store | None = None,  # type: ignore[name-defined]
) -> tuple[Backend, AsyncEngine]:
    """Load the checkpoint, build engine + serving and warm them up (`backend.server.warmup`: on a GPU every
    step shape, before the server answers `/v1/health`); returns the backend and the `AsyncEngine`.
    With `--tp N` this is rank 0, and the other ranks already run (backend/engine/ranks.py)."""
    start = time.perf_counter()
    settings.apply_compile_cache()  # before the first kernel compiles (CUDA graphs capture in Engine)
    dtype = getattr(torch, settings.dtype)
    device = rank_device(settings, 0)
    served = ServedModel.from_checkpoint(
        settings.model, name=settings.model_name, context_window=settings.context_window
    )
    vision = VisionEncoder.from_checkpoint(  # on rank 0 only: its embeddings go out with the step
        settings.model,
        pad_token_id=served.tokenizer.token_to_id(MEDIA_PAD),
        dtype=dtype,
        device=device,
        budget=ImageBudget(
            max_patches_per_request=settings.max_image_patches,
            max_concurrent=settings.image_encoders,
            max_waiting=settings.image_queue,
        ),
    )
    served.has_vision = vision is not None
    engine = build_engine(settings, device=device, on_rank_failure=on_rank_failure, store=store)
    warm = warm_up(engine, is_full=engine.runner.device.type == "cuda")
    async_engine = AsyncEngine(engine)
    kv_dtype = {"auto": settings.dtype, "bf16": "bfloat16", "fp8": "fp8_e4m3"}[settings.kv_dtype]
    card = msgspec.structs.replace(
        served.card(
            dtype=settings.dtype,
            kv_dtype=kv_dtype,
            page_size=settings.page_size * settings.dcp,  # a block-manager page, as `/v1/load` counts them
            num_pages=settings.max_pages,
        ),
        tp=settings.tp,
        ep=settings.ep or settings.tp,
        dcp=settings.dcp,
        startup_s=time.perf_counter() - start,
        warmup_s=warm.seconds,
    )
    print(
        f"kumo backend: {card.name} ready in {card.startup_s:.1f} s, of which warm-up {warm.seconds:.1f} s "
        f"({warm.num_steps} steps; compile cache {settings.compile_cache_dir or 'Triton default'})",
        file=sys.stderr,
        flush=True,
    )
    backend = Backend(
        serving=Serving(served, async_engine, images=vision, max_request_tokens=card.max_request_tokens),
        card=card,
        secret=settings.secret,
        metrics=BackendMetrics(lambda: engine.stats, async_engine.load),
    )
    return backend, async_engine


def main(argv: list[str]) -> int:
    settings = build_settings(argv)
    try:  # first: the port is this process's from now on, and one in use is an error at once
        sockets = (
            [inherit(settings.listen_fd)]
            if settings.listen_fd is not None
            else bind(settings.host, settings.port)
        )
    except OSError as exc:
        print(f"kumo backend: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        return 1
    failure = RankFailure()
    store = None
    try:
        if settings.tp > 1:  # ranks 1..N-1 first: rank 0's join waits for them
            store = rank_store(settings)
            group = RankGroup(settings, store.port, lambda r, code: failure(f"rank {r} exited with {code}"))
            failure.group = group
            join_group(settings, 0, store)
        backend, async_engine = build_backend(settings, on_rank_failure=failure, store=store)
    except (EngineError, OSError, ValueError, RuntimeError) as exc:  # cannot be served: say why, exit
        print(f"kumo backend: cannot serve {settings.model}: {exc}", file=sys.stderr)
        if failure.group is not None:
            failure.group.kill()
        for sock in sockets:
            sock.close()
        return 1
    failure.async_engine = async_engine
    async_engine.on_death = failure  # a dead engine thread: exit, the supervisor starts it again
    heap.freeze()  # start-up's heap out of every later full collection (backend/engine/heap.py)

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            async_engine.stop()
            if failure.group is not None:  # the engine thread is done: tell the other ranks to stop
                with contextlib.suppress(RanksDown):
                    ranks = async_engine.engine.runner.ranks
                    assert ranks is not None
                    ranks.send(None)
                failure.group.stop()

    app = create_app(backend, lifespan=lifespan)
    # the gateway's connection guard (header deadline and size); the cap is high, for many gateways' pools
    # its clients are gateways, each many streams from one address: no per-client cap
    limits = ConnectionLimits(max_connections=BACKEND_MAX_CONNECTIONS, max_connections_per_client=0)
    config = ServerConfig(
        app, limits, host=settings.host, port=settings.port, log_level="warning", access_log=False
    )
    try:
        listen(sockets, config.backlog)
    except OSError as exc:  # another server bound the port too (SO_REUSEADDR), and listened first
        print(f"kumo backend: cannot listen on {settings.host}:{settings.port}: {exc}", file=sys.stderr)
        if failure.group is not None:
            failure.group.kill()
        return 1
    uvicorn.Server(config).run(sockets=sockets)
    return 0

"""`POST /client/v4/accounts/{account_id}/ai/run/{model}` and `POST …/ai/run` (reference §1).

The model id arrives raw (`@cf/meta/x`) or with `/` percent-encoded (cloudflare-python 5.x sends
`@cf%2Fmeta%2Fx`); a catch-all path parameter takes both. Streams are not enveloped.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar
from urllib.parse import unquote

import anyio
import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway import batch
from gateway.auth import TenantContext
from gateway.body import decode, read_body
from gateway.errors import BadInput, ClientClosed, NoRoute
from gateway.inference import Answer, CallMeta, ModelInput, Prompt, Stream, Surface, input_decoder
from gateway.lifecycle import request_deadline
from gateway.observability import info_of
from gateway.services import Services
from schemas.catalog import ModelSpec
from schemas.workers_ai import Envelope, RunEnvelopeInput, RunOptions

T = TypeVar("T")
log = structlog.get_logger("kumo.run")

ACCOUNT_ID = re.compile(r"^[0-9a-f]{32}$")
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
STREAM_STALL_S = 30.0  # a streaming client that takes no frame this long is cut (checked every quarter)
_envelope_decoder = msgspec.json.Decoder(RunEnvelopeInput)


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def account_of(request: Request) -> str:
    """The path's account id; a malformed one is 404/7003 as on Cloudflare."""
    account_id = str(request.path_params["account_id"])
    if not ACCOUNT_ID.match(account_id):
        raise NoRoute(f"Could not route to {request.url.path}, perhaps your object identifier is invalid?")
    return account_id


async def authenticate(services: Services, request: Request, account_id: str) -> TenantContext:
    """Step 1: the caller's tenant, which must own `account_id`."""
    tenant = await services.authenticator.authenticate(request.headers.get("authorization"), account_id)
    info_of(request.scope).tenant_id = tenant.tenant_id
    return tenant


def resolve_model(services: Services, request: Request, tenant: TenantContext, name: str) -> ModelSpec:
    """The catalog checks of `InferenceService.resolve_model`, noted on the request's record."""
    return services.inference.resolve_model(tenant, name, info_of(request.scope))


def meta_of(services: Services, request: Request) -> CallMeta:
    """The request's record, `x-session-affinity`, and its deadline (`cf-aig-request-timeout`, or the
    configured limit) from now: taken as the handler starts, it covers the whole request."""
    return CallMeta(
        info=info_of(request.scope),
        affinity=request.headers.get("x-session-affinity"),
        deadline=request_deadline(request.headers, services.settings.request_timeout_s),
    )


async def read_input(services: Services, request: Request, meta: CallMeta) -> bytes:
    """The body (`read_body`), by the request's deadline too: 408/3046 whichever comes first."""
    s = services.settings
    async with services.lifecycle.bounded(meta.deadline):
        return await read_body(request, s.max_body_bytes, s.body_read_timeout_s)


async def unless_client_leaves(request: Request, work: Awaitable[T]) -> T:
    """`work` (an inference call), cancelled if the client disconnects first: a non-streaming answer
    has no byte to send before it is whole, so nothing else notices (a first-hour probe's `curl -m 4`
    left its request generating 1,500 tokens for 45 s, billed; an OpenAI SDK retries a timeout
    twice). The cancelled call closes its backend requests (the engine aborts them) and records the
    usage so far as a 499. The body has been read: the next ASGI message is the disconnect."""
    call = asyncio.ensure_future(work)
    left = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((call, left), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler cancelled (a shutdown) just as a stream was ready: closed
        ready = call.done() and not call.cancelled() and call.exception() is None
        if ready and isinstance(stream := call.result(), Stream):
            with anyio.CancelScope(shield=True):
                await stream.close()
        raise
    finally:
        left.cancel()
        if not call.done():  # the client left (or this handler was cancelled)
            call.cancel()
            with anyio.CancelScope(shield=True):
                await asyncio.gather(call, return_exceptions=True)
    if call.cancelled():
        raise ClientClosed("Client closed the request")
    return call.result()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class StreamResponse(StreamingResponse):
    """Server-sent events (`frames`, by default the stream's own) of a `Stream`, which is closed
    however the response ends: its frames taken, the client gone, or cancelled before the first.
    A client that takes nothing for `stall_s` while a frame waits is cut as gone: its stream is
    closed and settled then, not whenever it lets go of the connection (its reservation was held,
    its usage unrecorded, for as long as it kept the socket open)."""

    def __init__(
        self, stream: Stream, frames: AsyncIterator[bytes] | None = None, *, stall_s: float = STREAM_STALL_S
    ) -> None:
        super().__init__(
            stream.frames if frames is None else frames, media_type="text/event-stream", headers=SSE_HEADERS
        )
        self.stream = stream
        self.stall_s = stall_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        loop = asyncio.get_running_loop()
        waiting_since: float | None = None  # a send's start, while it waits for the client
        is_stalled = False

        async def watched(message: Message) -> None:  # two stores a frame (a timeout a send cost ~5 µs)
            nonlocal waiting_since
            waiting_since = loop.time()
            await send(message)
            waiting_since = None

        async def watchdog(cancel: anyio.CancelScope) -> None:
            nonlocal is_stalled
            while waiting_since is None or loop.time() - waiting_since < self.stall_s:
                await anyio.sleep(self.stall_s / 4)
            is_stalled = True
            cancel.cancel()

        try:
            async with anyio.create_task_group() as group:
                group.start_soon(watchdog, group.cancel_scope)
                await super().__call__(scope, receive, watched)
                group.cancel_scope.cancel()  # the response is over: the watchdog too
        except BaseExceptionGroup as failed:  # the response's own failure, as it would come unwatched
            if len(failed.exceptions) == 1:
                raise failed.exceptions[0]  # noqa: B904  (its own traceback is kept)
            raise
        finally:
            if is_stalled:  # as gone (uvicorn closes the unfinished response)
                log.info("stream_client_stalled", stall_s=self.stall_s)
            with anyio.CancelScope(shield=True):
                await self.stream.close()


def respond(answer: Answer | Stream, surface: Surface) -> Response:
    """The service's answer as HTTP: server-sent events, or JSON (enveloped on `/ai/run`)."""
    if isinstance(answer, Stream):
        return StreamResponse(answer)
    body = answer.body if surface == "openai" else Envelope(result=answer.body, success=True)
    return Response(msgspec.json.encode(body), media_type="application/json")


async def run_model(request: Request) -> Response:
    """`/ai/run/{model}`: the body is the model's input."""
    services = services_of(request)
    meta = meta_of(services, request)
    account_id = account_of(request)
    name = str(request.path_params["model"])
    name = unquote(name) if "%" in name else name
    tenant = await authenticate(services, request, account_id)
    model = resolve_model(services, request, tenant, name)
    raw = await read_input(services, request, meta)
    return await _run(request, meta, tenant, model, raw)


async def run_envelope(request: Request) -> Response:
    """`/ai/run` with `{model, input}` (`cf-aig-gateway-id` accepted, not required)."""
    services = services_of(request)
    meta = meta_of(services, request)
    account_id = account_of(request)
    tenant = await authenticate(services, request, account_id)
    raw = await read_input(services, request, meta)
    envelope = decode(raw, _envelope_decoder)
    model = resolve_model(services, request, tenant, envelope.model)
    reject_if_busy = envelope.options is not None and envelope.options.rejectIfBusy
    return await _run(request, meta, tenant, model, bytes(envelope.input), reject_if_busy=reject_if_busy)


async def _run(
    request: Request,
    meta: CallMeta,
    tenant: TenantContext,
    model: ModelSpec,
    raw: bytes,
    *,
    reject_if_busy: bool = False,
) -> Response:
    """The model's input run now, or (reference §1.6) a batch queued (`?queueRequest=true` with
    `{requests}`) or polled (`{request_id}`): the same for `/ai/run/{model}` and `/ai/run`'s input."""
    services = services_of(request)
    if batch.is_queue_request(request):
        return await batch.submit(services, tenant, model, raw)
    job_id = batch.poll_id(raw)
    if job_id is not None:
        return await batch.poll(services, tenant, model, job_id)
    body = _model_input(raw, model, reject_if_busy=reject_if_busy)
    answer = await unless_client_leaves(
        request, services.inference.run(tenant, model, Prompt(body, raw), "run", meta)
    )
    return respond(answer, "run")


def _model_input(raw: bytes, model: ModelSpec, *, reject_if_busy: bool) -> ModelInput:
    """The model's input, decoded once; the envelope's `options.rejectIfBusy` applies to it."""
    try:
        body = decode(raw, input_decoder(model, "run"))
    except BadInput as exc:
        if reject_if_busy and _is_options_not_an_object(exc.message):
            raise BadInput("Bad input: 'input.options' must be an object") from exc
        raise
    if reject_if_busy:
        body = msgspec.structs.replace(body, options=RunOptions(rejectIfBusy=True))
    return body


def _is_options_not_an_object(message: str) -> bool:
    return message.startswith("Bad input: Expected `object") and message.endswith("- at `$.options`")

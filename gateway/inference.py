"""One inference request through the gateway (DESIGN §2 steps 1–3 and 8), shared by `/ai/run`
and `/ai/v1/chat/completions`: authenticate, decode and normalise, admit, route, render, meter.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from typing import Literal

import anyio
import msgspec
import structlog
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway import render
from gateway.auth import TenantContext
from gateway.backend_client import tenant_salt, to_gateway_error
from gateway.body import decode
from gateway.errors import (
    KumoError,
    ModelNotAllowed,
    PaidModelOnFreePlan,
)
from gateway.lifecycle import request_timeout_s
from gateway.normalize import Context, Normalized, from_legacy
from gateway.normalize_openai import from_openai
from gateway.observability import info_of
from gateway.quotas import Admission
from gateway.services import Services
from gateway.usage import neurons
from schemas import backend as b
from schemas.admin import UsageRecord
from schemas.catalog import ModelSpec
from schemas.openai import ChatCompletionRequest
from schemas.workers_ai import Envelope, LegacyInput

Surface = Literal["run", "openai"]  # /ai/run (Workers AI answers) or /ai/v1 (plain OpenAI answers)
log = structlog.get_logger("kumo.inference")
IMAGE_TOKENS_ESTIMATE = 1024  # reserved per image at admission, trued up to the real count after
PROMPT_SCAFFOLD_TOKENS = 64  # a template's own text beyond the body (a default system prompt, BOS)
_DATA_URI = re.compile(rb'"data:[^"]*"')
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}
_legacy_decoder = msgspec.json.Decoder(LegacyInput)
_openai_decoder = msgspec.json.Decoder(ChatCompletionRequest)


async def authenticate(services: Services, request: Request, account_id: str) -> TenantContext:
    """Step 1: the caller's tenant, which must own `account_id`."""
    tenant = await services.authenticator.authenticate(request.headers.get("authorization"), account_id)
    info_of(request.scope).tenant_id = tenant.tenant_id
    return tenant


def resolve_model(services: Services, request: Request, tenant: TenantContext, name: str) -> ModelSpec:
    """The catalog checks: model known (5007), allowed for the tenant (403), plan (5035)."""
    model = services.catalog.get(name)
    info_of(request.scope).model = model.name
    if not tenant.can_use(model.name):
        raise ModelNotAllowed("The account is not allowed to access this model")
    if model.require_workers_paid and tenant.plan == "free":
        raise PaidModelOnFreePlan(f"Model {model.name} is not available on the Workers Free plan")
    return model


@dataclass
class Call:
    """One inference request of an authenticated tenant for a resolved model, from its raw body
    to its response; `surface` says which wire format answers."""

    services: Services
    request: Request
    tenant: TenantContext
    model: ModelSpec
    surface: Surface

    async def handle(self, raw: bytes) -> Response:
        """Decode (step 2), admit against the quotas (step 1), then normalise, which may fetch
        images, so a tenant over its limits costs no outbound fetch; then route and render."""
        body = self._decode(raw)
        admission = await self.services.limiter.admit(
            self.tenant, self.model.name, self._estimate(raw, body), self._worst_neurons(raw, body)
        )
        try:
            async with self.services.lifecycle.bounded():  # image fetches end at the drain deadline
                normalized = await self._normalize(body)
        except BaseException as exc:
            await self._abandon(admission, [], [], exc)
            raise
        return await self._respond(admission, normalized)

    def _decode(self, raw: bytes) -> LegacyInput | ChatCompletionRequest:
        if self.model.family == "legacy" and self.surface == "run":
            legacy = decode(raw, _legacy_decoder)
            assert isinstance(legacy, LegacyInput)
            return legacy
        chat = decode(raw, _openai_decoder)
        assert isinstance(chat, ChatCompletionRequest)
        return chat

    def _estimate(self, raw: bytes, body: LegacyInput | ChatCompletionRequest) -> int:
        """Tokens reserved at admission (trued up after): ~4 bytes a text token, a fixed allowance per
        image (its bytes are not tokens), plus every choice's max tokens."""
        text_bytes = len(_DATA_URI.sub(b'""', raw))
        images = raw.count(b'"data:')
        if isinstance(body, LegacyInput):
            if body.image is not None:
                text_bytes -= len(msgspec.json.encode(body.image))
                images += 1
            return text_bytes // 4 + images * IMAGE_TOKENS_ESTIMATE + body.max_tokens
        max_tokens = body.max_completion_tokens or body.max_tokens or self.model.default_max_tokens
        prompt = text_bytes // 4 + images * IMAGE_TOKENS_ESTIMATE
        return prompt + max_tokens * min(body.n or 1, self.services.settings.max_choices)

    def _worst_neurons(self, raw: bytes, body: LegacyInput | ChatCompletionRequest) -> float:
        """The most the request can cost, reserved from the daily budget at admission (the unused
        part is refunded after): every choice at its max tokens, and its prompt with one token per
        body byte (a byte-level BPE token covers at least one byte; the JSON framing of each message
        outweighs the template's markers around it) plus `PROMPT_SCAFFOLD_TOKENS`, each image at its
        reserved tokens, nothing cached."""
        text_bytes = len(_DATA_URI.sub(b'""', raw))
        images = raw.count(b'"data:')
        if isinstance(body, LegacyInput):
            if body.image is not None:
                text_bytes -= len(msgspec.json.encode(body.image))
                images += 1
            num_choices, max_tokens = 1, body.max_tokens
        else:
            num_choices = min(body.n or 1, self.services.settings.max_choices)
            max_tokens = body.max_completion_tokens or body.max_tokens or self.model.default_max_tokens
        prompt = text_bytes + images * IMAGE_TOKENS_ESTIMATE + PROMPT_SCAFFOLD_TOKENS
        return neurons(self.model.price, prompt * num_choices, 0, max_tokens * num_choices)

    async def _normalize(self, body: LegacyInput | ChatCompletionRequest) -> Normalized:
        info = info_of(self.request.scope)
        s = self.services.settings
        ctx = Context(
            request_id=info.request_id,
            tenant_salt=tenant_salt(s.server_secret, self.tenant.tenant_id),
            images=self.services.images,
            max_images=s.max_images,
            max_choices=s.max_choices,
        )
        if isinstance(body, LegacyInput):
            return await from_legacy(body, self.model, ctx)
        return await from_openai(body, self.model, ctx, allow_prompt=self.surface == "run")

    async def _respond(self, admission: Admission, normalized: Normalized) -> Response:
        """Steps 3 and 8: route every choice, render; settle and record usage at the end."""
        done = [render.Completion() for _ in normalized.requests]
        # every choice is routed at once; any failure before the first byte closes the others
        started = await asyncio.gather(
            *(self._started(r) for r in normalized.requests), return_exceptions=True
        )
        streams = [s for s in started if not isinstance(s, BaseException)]
        failure = next((s for s in started if isinstance(s, BaseException)), None)
        if failure is not None:
            await self._abandon(admission, done, streams, failure)
            raise failure
        if normalized.stream:
            return StreamingResponse(
                self._stream(admission, normalized, streams, done),
                media_type="text/event-stream",
                headers=SSE_HEADERS,
            )
        try:
            await asyncio.gather(*(self._collect(s, c) for s, c in zip(streams, done, strict=True)))
        except BaseException as exc:
            await self._abandon(admission, done, streams, exc)
            raise
        totals = render.Totals.of(done)
        try:
            payload = self._payload(done, totals, normalized)
        except KumoError as exc:  # JSON mode not met: the tokens were spent, the answer is a 400
            await self._settle(admission, done, status=exc.status)
            raise
        await self._settle(admission, done, status=200)
        return Response(payload, media_type="application/json")

    def _payload(self, done: list[render.Completion], totals: render.Totals, normalized: Normalized) -> bytes:
        if self.surface == "openai" or self.model.family == "openai":
            body = render.chat_completion(
                done,
                totals,
                model=self.model.name,
                id=self._id(),
                created=int(time.time()),
                logprobs=normalized.logprobs,
            )
            return msgspec.json.encode(
                body if self.surface == "openai" else Envelope(result=body, success=True)
            )
        else:
            result = render.legacy_result(done[0], totals, json_mode=normalized.json_mode)
            return msgspec.json.encode(Envelope(result=result, success=True))

    def _id(self) -> str:
        return f"chatcmpl-{info_of(self.request.scope).request_id}"

    async def _started(self, generate: b.GenerateRequest) -> AsyncGenerator[b.Event, None]:
        """Route one choice and wait for its first event, so that routing failures and immediate
        backend errors (context window, busy) become a proper HTTP error before any byte is sent."""
        affinity = self.request.headers.get("x-session-affinity")
        events = self.services.lifecycle.guard(
            self.services.router.generate(self.model, generate, affinity=affinity),
            request_timeout_s(self.request.headers, self.services.settings.request_timeout_s),
        )
        try:
            url, first = await anext(events)
        except StopAsyncIteration as exc:
            raise KumoError("Unknown internal error") from exc
        info_of(self.request.scope).replica = url
        if isinstance(first, b.Error):
            await events.aclose()
            raise to_gateway_error(first)

        async def rest() -> AsyncGenerator[b.Event, None]:
            try:
                yield first
                async for _, event in events:
                    yield event
            finally:
                await events.aclose()

        return rest()

    async def _collect(self, events: AsyncIterator[b.Event], into: render.Completion) -> None:
        async for event in events:
            into.feed(event)
        into.check_finished()

    async def _stream(
        self,
        admission: Admission,
        normalized: Normalized,
        streams: list[AsyncGenerator[b.Event, None]],
        done: list[render.Completion],
    ) -> AsyncIterator[bytes]:
        status = 200
        merged = merge(streams)
        price = self.model.price
        neurons_of = lambda t: neurons(price, t.prompt_tokens, t.cached_tokens, t.completion_tokens)  # noqa: E731
        openai_family = self.surface == "openai" or self.model.family == "openai"
        try:
            if openai_family:
                frames = render.openai_stream(
                    merged,
                    done,
                    model=self.model.name,
                    id=self._id(),
                    created=int(time.time()),
                    logprobs=normalized.logprobs,
                    workers_trailer=self.surface == "run",
                    include_usage=normalized.include_usage,
                    neurons_of=neurons_of,
                )
            else:
                frames = render.legacy_stream(merged, done, neurons_of)
            async for frame in frames:
                yield frame
        except Exception as exc:
            error = exc if isinstance(exc, KumoError) else KumoError("Unknown internal error")
            if not isinstance(exc, KumoError):
                log.error("stream_failed", exc_info=exc)
            status = error.status
            info_of(self.request.scope).error_code = error.code
            yield render.stream_error(error, openai=openai_family)
        finally:
            # shielded: a client that went away cancels this task, yet the backend request must
            # still be closed (aborting it in the engine) and the usage so far recorded
            with anyio.CancelScope(shield=True):
                await merged.aclose()
                await self._settle(
                    admission, done, status=status if status != 200 or all(c.finish for c in done) else 499
                )

    async def _abandon(
        self,
        admission: Admission,
        done: list[render.Completion],
        streams: list[AsyncGenerator[b.Event, None]],
        exc: BaseException,
    ) -> None:
        for stream in streams:
            await stream.aclose()
        await self._settle(admission, done, status=exc.status if isinstance(exc, KumoError) else 500)

    async def _settle(self, admission: Admission, done: list[render.Completion], *, status: int) -> None:
        totals = render.Totals.of(done)
        spent = neurons(
            self.model.price, totals.prompt_tokens, totals.cached_tokens, totals.completion_tokens
        )
        info = info_of(self.request.scope)
        info.prompt_tokens, info.cached_tokens, info.completion_tokens = (
            totals.prompt_tokens,
            totals.cached_tokens,
            totals.completion_tokens,
        )
        await self.services.limiter.settle(
            admission, tokens=totals.prompt_tokens + totals.completion_tokens, neurons=spent
        )
        self.services.ledger.record(
            UsageRecord(
                tenant_id=self.tenant.tenant_id,
                model=self.model.name,
                request_id=info.request_id,
                prompt_tokens=totals.prompt_tokens,
                cached_tokens=totals.cached_tokens,
                completion_tokens=totals.completion_tokens,
                neurons=spent,
                status=status,
            )
        )


async def merge(streams: list[AsyncGenerator[b.Event, None]]) -> AsyncGenerator[tuple[int, b.Event], None]:
    """Interleave the choices' event streams as they arrive, tagging each event with its index.
    Closing the merged stream cancels every producer (closing their backend connections)."""
    if len(streams) == 1:
        async with contextlib.aclosing(streams[0]) as only:
            async for event in only:
                yield 0, event
        return
    queue: asyncio.Queue[tuple[int, b.Event | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[b.Event, None]) -> None:
        try:
            async for event in stream:
                await queue.put((i, event))
        except Exception as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

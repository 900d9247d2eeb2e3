"""The inference service (DESIGN §2 steps 1–3 and 8), shared by `/ai/run`, `/ai/v1/chat/completions`
and the batch worker: admit a decoded request, normalise it, route every choice, render, meter.

No HTTP here: the routes (`gateway.run`, `gateway.openai_compat`) decode the body once into a
typed `ModelInput` and wrap what comes back (`Answer` or `Stream`) into a response; the batch
worker calls the same service with the input it stored.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Literal

import anyio
import anyio.lowlevel
import msgspec
import structlog

from gateway import render
from gateway.auth import TenantContext
from gateway.backend_client import Dispatch, tenant_salt, to_gateway_error
from gateway.catalog import Catalog
from gateway.errors import (
    Aborted,
    KumoError,
    ModelNotAllowed,
    PaidModelOnFreePlan,
    Timeout,
)
from gateway.images import ImageFetcher
from gateway.lifecycle import Lifecycle
from gateway.normalize import Context, Normalized, from_legacy
from gateway.normalize_openai import (
    from_openai,
    image_urls_of,
    max_tokens_of,
    num_choices_of,
    num_images_of,
)
from gateway.observability import RequestInfo
from gateway.pools import Router
from gateway.quotas import Admission, Limiter
from gateway.settings import GatewaySettings
from gateway.usage import UsageLedger, neurons
from schemas import backend as b
from schemas.admin import UsageRecord
from schemas.catalog import ModelSpec
from schemas.openai import ChatCompletion, ChatCompletionRequest
from schemas.workers_ai import LegacyInput, LegacyResult

Surface = Literal["run", "openai"]  # /ai/run (Workers AI answers) or /ai/v1 (plain OpenAI answers)
ModelInput = LegacyInput | ChatCompletionRequest  # a text-generation model's input, by family
log = structlog.get_logger("kumo.inference")
# reserved per image at admission, data: URI or URL alike, trued up to the real count after: what a
# capped image costs (the backend's 16,384 patches per image, 130 × 130 once padded, merged 2×2)
IMAGE_TOKENS_ESTIMATE = 65 * 65
PROMPT_SCAFFOLD_TOKENS = 64  # a template's own text beyond the body (a default system prompt, BOS)
_legacy_decoder = msgspec.json.Decoder(LegacyInput)
_openai_decoder = msgspec.json.Decoder(ChatCompletionRequest)


def input_decoder(model: ModelSpec, surface: Surface) -> msgspec.json.Decoder[ModelInput]:
    """The decoder of `model`'s input: the legacy family's on `/ai/run`, Chat Completions otherwise."""
    if model.family == "legacy" and surface == "run":
        return _legacy_decoder  # type: ignore[return-value]
    return _openai_decoder  # type: ignore[return-value]


@dataclass(frozen=True)
class Prompt:
    """One decoded model input, with the JSON it came from (its size is the admission estimate)."""

    body: ModelInput
    raw: bytes


@dataclass(frozen=True)
class CallMeta:
    """What the caller's edge knows about one call: the request's record (its id names the backend
    requests; tokens, replica and error code are written back), session affinity and deadline."""

    info: RequestInfo = field(default_factory=RequestInfo)
    affinity: str | None = None
    # loop time at which the call ends with 408/3046, taken as its HTTP handler starts (so it covers
    # reading the body too); None: the settings' `request_timeout_s` from the call's start
    deadline: float | None = None


@dataclass(frozen=True)
class Answer:
    """A whole answer: the Chat Completion (OpenAI family or surface) or the legacy result."""

    body: ChatCompletion | LegacyResult


@dataclass(frozen=True)
class Stream:
    """A streamed answer: its server-sent event frames, metered when they end. `close` must run
    once the response is over, however it ended (`run.StreamResponse`): a response cancelled before
    its first frame never starts `frames`, whose own clean-up then never runs (the backend request
    went on generating, unbilled, its reservation held). Closing twice, or after the frames ended,
    does nothing."""

    frames: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]


@dataclass(frozen=True)
class InferenceService:
    """Everything one inference call needs; built from `Services` (the batch worker swaps the router
    for one at batch priority)."""

    settings: GatewaySettings
    catalog: Catalog
    router: Router
    limiter: Limiter
    ledger: UsageLedger
    images: ImageFetcher
    lifecycle: Lifecycle

    def resolve_model(self, tenant: TenantContext, name: str, info: RequestInfo) -> ModelSpec:
        """The catalog checks: model known (5007), allowed for the tenant (403), plan (5035)."""
        model = self.catalog.get(name)
        info.model = model.name
        if not tenant.can_use(model):
            raise ModelNotAllowed("The account is not allowed to access this model")
        if model.require_workers_paid and tenant.plan == "free":
            raise PaidModelOnFreePlan(f"Model {model.name} is not available on the Workers Free plan")
        return model

    async def run(
        self, tenant: TenantContext, model: ModelSpec, prompt: Prompt, surface: Surface, meta: CallMeta
    ) -> Answer | Stream:
        """Run `prompt` for `tenant` on `model`; `surface` says which wire format answers."""
        deadline = meta.deadline
        if deadline is None:
            deadline = asyncio.get_running_loop().time() + self.settings.request_timeout_s
        return await _Call(self, tenant, model, surface, meta, deadline).handle(prompt)


@dataclass(frozen=True)
class _Reserved:
    """What admission reserved for one call (trued up when it settles), and the prompt tokens it
    estimated: what a choice cut before the backend's usage came is billed for its prompt."""

    admission: Admission
    prompt_tokens: int


@dataclass
class _Call:
    """One inference request of an authenticated tenant for a resolved model, from its decoded
    input to its answer."""

    service: InferenceService
    tenant: TenantContext
    model: ModelSpec
    surface: Surface
    meta: CallMeta
    deadline: float  # loop time: every wait of the call ends with 408/3046 then

    async def handle(self, prompt: Prompt) -> Answer | Stream:
        """Admit against the quotas (step 1), then normalise (step 2), which may fetch images, so a
        tenant over its limits costs no outbound fetch; then route and render."""
        admission = await self.service.limiter.admit(
            self.tenant, self.model.name, self._estimate(prompt), self._worst_neurons(prompt)
        )
        # a cut answer's prompt: the estimate with the template's own tokens (the body alone
        # undercounts a short prompt), still within the worst case reserved
        reserved = _Reserved(admission, self._prompt_estimate(prompt) + PROMPT_SCAFFOLD_TOKENS)
        try:
            # image fetches end at the request's deadline (their own limit may be longer) or the drain's
            async with self.service.lifecycle.bounded(self.deadline):
                normalized = await self._normalize(prompt.body)
        except BaseException as exc:
            await self._abandon(reserved, [], [], exc)
            raise
        return await self._respond(reserved, normalized)

    def _text_bytes_and_images(self, prompt: Prompt) -> tuple[int, int]:
        """The body's text bytes (inline images' bytes are not text) and its images, each counted at
        a capped image's tokens, fetched from a URL or not (a URL is not fetched before admission)."""
        body = prompt.body
        text_bytes = len(prompt.raw) - _inline_image_bytes(body)
        if isinstance(body, LegacyInput):
            return text_bytes, int(body.image is not None)
        return text_bytes, num_images_of(body)

    def _choices_and_max_tokens(self, body: ModelInput) -> tuple[int, int]:
        if isinstance(body, LegacyInput):
            return 1, body.max_tokens
        return min(num_choices_of(body), self.service.settings.max_choices), max_tokens_of(body, self.model)

    def _prompt_estimate(self, prompt: Prompt) -> int:
        """The prompt's tokens as admission sees them: ~4 bytes a text token, a capped image's
        tokens per image."""
        text_bytes, images = self._text_bytes_and_images(prompt)
        return text_bytes // 4 + images * IMAGE_TOKENS_ESTIMATE

    def _estimate(self, prompt: Prompt) -> int:
        """Tokens reserved at admission (trued up after): the prompt's estimate plus every choice's
        max tokens."""
        num_choices, max_tokens = self._choices_and_max_tokens(prompt.body)
        return self._prompt_estimate(prompt) + max_tokens * num_choices

    def _worst_neurons(self, prompt: Prompt) -> float:
        """The most the request can cost, reserved from the daily budget at admission (the unused
        part is refunded after): every choice at its max tokens, and its prompt with one token per
        body byte (a byte-level BPE token covers at least one byte; the JSON framing of each message
        outweighs the template's markers around it) plus `PROMPT_SCAFFOLD_TOKENS`, each image at its
        reserved tokens, nothing cached."""
        text_bytes, images = self._text_bytes_and_images(prompt)
        num_choices, max_tokens = self._choices_and_max_tokens(prompt.body)
        prompt_tokens = text_bytes + images * IMAGE_TOKENS_ESTIMATE + PROMPT_SCAFFOLD_TOKENS
        return neurons(self.model.price, prompt_tokens * num_choices, 0, max_tokens * num_choices)

    async def _normalize(self, body: ModelInput) -> Normalized:
        s = self.service.settings
        ctx = Context(
            request_id=self.meta.info.request_id,
            tenant_salt=tenant_salt(s.server_secret, self.tenant.tenant_id),
            images=self.service.images,
            max_images=s.max_images,
            max_choices=s.max_choices,
            max_image_bytes_total=s.max_image_bytes_total,
        )
        if isinstance(body, LegacyInput):
            return await from_legacy(body, self.model, ctx)
        return await from_openai(body, self.model, ctx, allow_prompt=self.surface == "run")

    async def _respond(self, reserved: _Reserved, normalized: Normalized) -> Answer | Stream:
        """Steps 3 and 8: route every choice, render; settle and record usage at the end."""
        done = [render.Completion() for _ in normalized.requests]
        affinity = self.meta.affinity or normalized.affinity
        if affinity is None and len(normalized.requests) > 1:
            # one replica takes every choice: its prefix cache shares their prompt (and encodes
            # their images once); `Totals.of` bills what it did not serve
            affinity = self.meta.info.request_id
        # the first choice alone, then the others at once: by its first event the replica holds its
        # prompt's pages in the prefix cache, and the others start from them (routed at once, each
        # prefilled the whole prompt); any failure before the first byte closes the others
        choices = list(zip(normalized.requests, done, strict=True))
        started: list[ChoiceEvents | BaseException] = []
        try:
            started += await asyncio.gather(self._started(*choices[0], affinity), return_exceptions=True)
            if len(choices) > 1 and not isinstance(started[0], BaseException):
                started += await asyncio.gather(
                    *(self._started(r, c, affinity) for r, c in choices[1:]), return_exceptions=True
                )
        except BaseException as exc:  # cancelled while routing (a batch job handed back, a shutdown)
            with anyio.CancelScope(shield=True):  # else its worst case stays reserved for the day
                opened = [s for s in started if not isinstance(s, BaseException)]
                await self._abandon(reserved, done, opened, exc)
            raise
        streams = [s for s in started if not isinstance(s, BaseException)]
        failure = next((s for s in started if isinstance(s, BaseException)), None)
        if failure is not None:
            await self._abandon(reserved, done, streams, failure)
            raise failure
        if normalized.stream:
            call = _Streaming(self, reserved, streams, done)
            return Stream(self._stream(call, normalized), close=call.abandon)
        collecting = [asyncio.ensure_future(self._collect(s, c)) for s, c in zip(streams, done, strict=True)]
        try:
            await asyncio.gather(*collecting)
        except BaseException as exc:
            # a choice failed (or the caller left): gather leaves the others running, and a stream
            # still being read cannot be closed, so they are cancelled and awaited first
            with anyio.CancelScope(shield=True):
                for task in collecting:
                    task.cancel()
                await asyncio.gather(*collecting, return_exceptions=True)
                await self._abandon(reserved, done, streams, exc)
            raise
        totals = render.Totals.of(done)
        try:
            body = self._body(done, totals, normalized)
        except KumoError as exc:  # JSON mode not met: the tokens were spent, the answer is a 400
            await self._settle(reserved, done, status=exc.status)
            raise
        await self._settle(reserved, done, status=200)
        return Answer(body)

    def _body(
        self, done: list[render.Completion], totals: render.Totals, normalized: Normalized
    ) -> ChatCompletion | LegacyResult:
        if self.surface == "openai" or self.model.family == "openai":
            return render.chat_completion(
                done,
                totals,
                model=self.model.name,
                id=self._id(),
                created=int(time.time()),
                logprobs=normalized.logprobs,
            )
        return render.legacy_result(done[0], totals, json_mode=normalized.json_mode)

    def _id(self) -> str:
        return f"chatcmpl-{self.meta.info.request_id}"

    async def _started(
        self, generate: b.GenerateRequest, into: render.Completion, affinity: str | None
    ) -> ChoiceEvents:
        """Route one choice and wait for its first event, so that routing failures and immediate
        backend errors (context window, busy) become a proper HTTP error before any byte is sent.
        A wait cut by the deadline, the drain or the caller leaves the choice `is_started` if a
        replica held it then: the backend may have been prefilling its prompt (nothing comes before
        the first event to say how far it got). One cut before any replica had it (routing, a
        connection) or after the replica gave it back (refused, failed) cost no backend work."""
        dispatch = Dispatch()
        events = self.service.lifecycle.guard(
            self.service.router.generate(self.model, generate, affinity=affinity, dispatch=dispatch),
            self.deadline,
        )
        try:
            url, first = await anext(events)
            while isinstance(first, b.Started):  # the prompt's count: then the first output's events
                into.feed(first)
                url, first = await anext(events)
        except StopAsyncIteration as exc:
            raise KumoError("Unknown internal error") from exc
        except (Timeout, Aborted, asyncio.CancelledError):
            into.is_started = dispatch.is_held or into.started is not None
            raise
        self.meta.info.replica = url
        if isinstance(first, b.Error):
            await events.aclose()
            raise to_gateway_error(first)
        into.is_started = True
        return ChoiceEvents(first, events, into)

    async def _collect(self, events: AsyncIterator[b.Event], into: render.Completion) -> None:
        async for event in events:
            into.feed(event)
        into.check_finished()

    async def _stream(self, call: _Streaming, normalized: Normalized) -> AsyncIterator[bytes]:
        status = 200
        merged, done = call.merged, call.done
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
            self.meta.info.error_code = error.code
            await call.finish(status)  # now: a client too slow to take the frame may never take it
            yield render.stream_error(error, openai=openai_family)
        finally:
            await call.finish(status if status != 200 or all(c.finish for c in done) else 499)

    async def _abandon(
        self,
        reserved: _Reserved,
        done: list[render.Completion],
        streams: list[ChoiceEvents],
        exc: BaseException,
    ) -> None:
        try:
            for stream in streams:
                try:
                    await stream.aclose()
                except Exception as close_exc:  # one that will not close must not skip the settlement
                    log.warning("choice_close_failed", exc_info=close_exc)
        finally:
            # cancelled: the caller left (`run.unless_client_leaves`) or the gateway stops
            status = 499 if isinstance(exc, asyncio.CancelledError) else 500
            await self._settle(reserved, done, status=exc.status if isinstance(exc, KumoError) else status)

    async def _settle(self, reserved: _Reserved, done: list[render.Completion], *, status: int) -> None:
        """True up the quotas and record the usage: the backend's, or for choices cut before it
        came, the lower bound of `render.Completion.consumed`."""
        totals = render.Totals.of(done, reserved.prompt_tokens)
        spent = neurons(
            self.model.price, totals.prompt_tokens, totals.cached_tokens, totals.completion_tokens
        )
        info = self.meta.info
        info.prompt_tokens, info.cached_tokens, info.completion_tokens = (
            totals.prompt_tokens,
            totals.cached_tokens,
            totals.completion_tokens,
        )
        # settled before the ledger has it: a day counter seeded since admission lacks this response
        await self.service.limiter.settle(
            reserved.admission, tokens=totals.prompt_tokens + totals.completion_tokens, neurons=spent
        )
        self.service.ledger.record(
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


def _inline_image_bytes(body: ModelInput) -> int:
    """The JSON bytes of the body's inline images (image parts' data: URIs, the legacy `image`
    field), which admission counts as images rather than text. Taken from the decoded body, never
    from a pattern over the raw bytes, so that text which merely looks like a data: URI is counted
    as text. Each is measured as msgspec writes it, never longer than the same value in the body
    (which may escape more), so the text left over is never undercounted."""
    if isinstance(body, LegacyInput):
        return 0 if body.image is None else len(msgspec.json.encode(body.image))
    return sum(len(msgspec.json.encode(url)) for url in image_urls_of(body) if url.startswith("data:"))


class _Streaming:
    """A streamed call's end, once: its backend requests closed (the engine aborts what still runs)
    and its usage settled, however the stream ended, or if it never started."""

    def __init__(
        self, call: _Call, reserved: _Reserved, streams: list[ChoiceEvents], done: list[render.Completion]
    ) -> None:
        self.call, self.reserved, self.streams, self.done = call, reserved, streams, done
        self.merged = merge(streams)
        self.is_finished = False

    async def finish(self, status: int) -> None:
        """Close and settle with `status`, unless done already. Shielded: a client that went away
        cancels the task, yet the backend requests must still be closed and the usage recorded."""
        if self.is_finished:
            return
        self.is_finished = True
        with anyio.CancelScope(shield=True):
            await self.merged.aclose()
            for stream in self.streams:  # a merge never started holds them unopened
                await stream.aclose()
            await self.call._settle(self.reserved, self.done, status=status)

    async def abandon(self) -> None:
        """The response is over: a stream that did not finish is a client's cut (499)."""
        await self.finish(499)


class ChoiceEvents:
    """A routed choice's events from its first (already read); `aclose` closes its backend stream
    whether or not they were read (a generator closed before its first step ran none of its body,
    so an error path that closed a choice never read left the backend generating it). Each event is
    noted on `into` as read from the backend (`Completion.note_read`), the first at once: a choice
    cut later is billed what the backend sent, whatever the client took of it."""

    def __init__(
        self, first: b.Event, events: AsyncGenerator[tuple[str, b.Event], None], into: render.Completion
    ) -> None:
        self._first: b.Event | None = first
        self._events = events
        self._into = into
        into.note_read(first)

    def __aiter__(self) -> ChoiceEvents:
        return self

    async def __anext__(self) -> b.Event:
        if self._first is not None:
            first, self._first = self._first, None
            return first
        _, event = await anext(self._events)  # StopAsyncIteration at the end
        self._into.note_read(event)
        return event

    async def aclose(self) -> None:
        await self._events.aclose()


# events a stream's client has not taken yet, at most (a token's event a unit, each of its logprobs'
# entries one more, the alternatives included): ~6 MB of them; past it the client is too far behind
MAX_UNREAD_UNITS = 65_536


class TooSlow(Aborted):
    """The client stopped taking its stream while the backend went on: the stream was cut."""


def _units(event: b.Event) -> int:
    """What an event not yet taken holds: a generated piece 1, its logprobs' entries 1 each; the
    ending events none (one a choice: a whole answer is never cut at its last event)."""
    if isinstance(event, b.TextDelta) and event.logprobs:
        return 1 + sum(1 + len(t.top) for t in event.logprobs)
    return 1 if isinstance(event, b.TextDelta | b.ReasoningDelta | b.ToolCallDelta) else 0


async def merge(
    streams: list[ChoiceEvents], *, max_unread: int = MAX_UNREAD_UNITS
) -> AsyncGenerator[tuple[int, b.Event], None]:
    """Interleave the choices' event streams as they arrive, tagging each event with its index.
    Each is read as fast as its backend sends it, whatever the pace of the client (and noted as
    read: `ChoiceEvents`): a stream cut later is billed what the engine computed, not what the
    client took (a client that stopped reading, but stayed, once left the engine generating to
    `max_tokens` with only what it had taken billed). What the client has not taken is bounded
    (`max_unread` units): past it the backends are closed (the engine stops) and, once the events
    before are taken, the stream ends with `TooSlow`. Closing the merged stream cancels every
    producer still reading (closing their backend connections)."""
    queue: asyncio.Queue[tuple[int, b.Event | BaseException | None, int]] = asyncio.Queue()
    unread = 0
    closing = [False] * len(streams)

    async def pump(i: int, stream: ChoiceEvents) -> None:
        nonlocal unread
        try:
            async for event in stream:
                units = _units(event)
                unread += units
                queue.put_nowait((i, event, units))
                if unread > max_unread:
                    raise TooSlow("The client took the stream too slowly: it was cut")
        except Exception as exc:
            queue.put_nowait((i, exc, 0))
        finally:
            closing[i] = True  # never cancelled from here: its backend connection is closed whole
            try:
                await stream.aclose()
            finally:
                queue.put_nowait((i, None, 0))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        num_taken = 0
        while remaining:
            i, item, units = await queue.get()  # no suspension while events wait
            unread -= units
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                num_taken += 1
                if num_taken % 64 == 0:
                    # a client gone makes every send return at once: without a suspension the
                    # cancel that says so waited for the whole backlog (0.5 s of a blocked loop)
                    await anyio.lowlevel.checkpoint()
                yield i, item
    finally:
        for i, task in enumerate(tasks):
            if not closing[i]:
                task.cancel()
        # shielded: anyio (Starlette's streaming response) cancels again at every await until the
        # scope is left; a second cancel cut the pumps' closing of their backend connections short
        # (httpcore shields its clean-up from anyio's cancels alone), left them open and generating
        with anyio.CancelScope(shield=True):
            await asyncio.gather(*tasks, return_exceptions=True)

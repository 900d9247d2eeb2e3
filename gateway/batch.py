"""Async batch (reference §1.6): `POST …/ai/run/{model}?queueRequest=true` with `{requests: [...]}`
queues a job and answers `{status: "queued", request_id}`; `POST …/ai/run/{model}` with
`{request_id}` polls it: `queued`, `running`, or the responses with their `external_reference`
and the job's usage.

Jobs live in the store (`gateway.store.batch`), so any gateway sharing the database may run one,
exactly one does, and a job survives its gateway: a stopping gateway hands its job back, a dead
one's lease expires and another takes it over, running only the requests not answered yet. Each
gateway runs one `BatchWorker`; it runs several jobs at once, at most one per tenant, their requests
through the same path as `/ai/run` (quotas, normalisation, routing, metering) a few at a time,
shared round-robin by tenant, at a lower engine priority than interactive requests. Results are
kept for `batch_result_ttl_s`, then purged.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import uuid
from dataclasses import replace
from typing import Any, Protocol

import msgspec
import structlog
from sqlalchemy.exc import SQLAlchemyError
from starlette.requests import Request
from starlette.responses import Response

from gateway.auth import TenantContext
from gateway.backend_client import Dispatch
from gateway.body import decode, decode_json
from gateway.errors import BadInput, Busy, KumoError, NotFound, RateLimited, Unavailable
from gateway.fair_slots import FairSlots
from gateway.inference import Answer, CallMeta, InferenceService, Prompt, input_decoder
from gateway.lifecycle import Lifecycle
from gateway.pools import Router
from gateway.settings import GatewaySettings
from gateway.store import Store
from gateway.store.batch import DONE, BatchJob, BatchQueue, KeptAnswer, Refused
from gateway.store.rows import now
from schemas import backend as b
from schemas.batch import BatchDone, BatchItem, BatchPoll, BatchStatus, BatchSubmit, BatchUsage
from schemas.catalog import ModelSpec
from schemas.workers_ai import Envelope, ErrorItem

log = structlog.get_logger("kumo.batch")
QUEUE_PARAM = "queueRequest"
MAX_ATTEMPTS = 5  # a job whose gateways keep dying is failed, not retried forever
MAX_ITEM_RETRIES = 30  # 429/503 on one request: wait as told, this many times
PURGE_INTERVAL_S = 60.0
HAND_BACK_TIMEOUT_S = 10.0  # a stopping gateway waits this long for its requests, then for the store

_submit_decoder = msgspec.json.Decoder(BatchSubmit)
_poll_decoder = msgspec.json.Decoder(BatchPoll)


class QueuedRequest(msgspec.Struct, forbid_unknown_fields=True):
    """How one request is kept in the store: the model's input, and the caller's reference."""

    input: msgspec.Raw
    external_reference: str | None = None


_stored = msgspec.json.Decoder(list[QueuedRequest])


class Answered(msgspec.Struct, forbid_unknown_fields=True):
    """One request of a running job, answered (and billed)."""

    index: int
    item: BatchItem
    prompt_tokens: int
    completion_tokens: int


_item_decoder = msgspec.json.Decoder(BatchItem)


class Progress:
    """A running job's requests answered for good (`is_final`): those its earlier attempts kept in
    the store, and those answered since. The next lease renewal, or the hand-back, writes those not
    written yet, and only those, so the gateway that takes the job over runs only the rest (it once
    ran, and billed, the whole job again) and a job's writes grow with its answers, not their square."""

    def __init__(self, job: BatchJob) -> None:
        self.answered: dict[int, Answered] = {}
        self._unwritten: dict[int, KeptAnswer] = {}
        for kept in job.answers:
            if not 0 <= kept.index < job.num_requests:
                continue
            try:
                item = _item_decoder.decode(kept.item)
            except msgspec.DecodeError:  # unreadable: the request runs again
                log.warning("batch_answer_unreadable", request_id=job.id, index=kept.index)
                continue
            self.answered[kept.index] = Answered(kept.index, item, kept.prompt_tokens, kept.completion_tokens)

    def add(self, answer: Answered) -> None:
        self.answered[answer.index] = answer
        self._unwritten[answer.index] = KeptAnswer(
            answer.index, msgspec.json.encode(answer.item), answer.prompt_tokens, answer.completion_tokens
        )

    def unwritten(self) -> list[KeptAnswer]:
        return list(self._unwritten.values())

    def written(self, answers: list[KeptAnswer]) -> None:
        for answer in answers:
            self._unwritten.pop(answer.index, None)


class BatchServices(Protocol):
    """What batches need of `gateway.services.Services` (a protocol, so that batch need not import
    it: `Services` holds the `BatchWorker`)."""

    @property
    def settings(self) -> GatewaySettings: ...
    @property
    def store(self) -> Store: ...
    @property
    def lifecycle(self) -> Lifecycle: ...
    @property
    def inference(self) -> InferenceService: ...
    @property
    def batch(self) -> BatchWorker: ...


# ---- the routes' side ----------------------------------------------------------------------------------
def is_queue_request(request: Request) -> bool:
    return request.query_params.get(QUEUE_PARAM, "").lower() == "true"


def poll_id(raw: bytes) -> str | None:
    """The `request_id` of a poll body (exactly `{"request_id": …}`), else None."""
    if b'"request_id"' not in raw:
        return None
    try:
        return _poll_decoder.decode(raw).request_id
    except (msgspec.ValidationError, msgspec.DecodeError):
        return None


def _checked(raw: msgspec.Raw, i: int, model: ModelSpec) -> QueuedRequest:
    """One queued request, validated now with the model's decoder (a 400 names `$.requests[i]`)."""
    try:
        return _checked_item(raw, i, model)
    except RecursionError as exc:  # decoding, re-encoding or reading its whole floats
        raise BadInput(f"Bad input: `$.requests[{i}]` is nested too deeply") from exc


def _checked_item(raw: msgspec.Raw, i: int, model: ModelSpec) -> QueuedRequest:
    value = msgspec.json.decode(raw)
    if not isinstance(value, dict):
        raise BadInput(f"Bad input: Expected `object` - at `$.requests[{i}]`")
    reference = value.pop("external_reference", None)
    if reference is not None and (not isinstance(reference, str) or len(reference) > 1024):
        raise BadInput(
            f"Bad input: Expected `str` of at most 1024 characters - at `$.requests[{i}].external_reference`"
        )
    value.pop("stream", None)  # a queued request is answered whole
    value.pop("stream_options", None)
    item = msgspec.json.encode(value)
    try:
        decode_json(item, input_decoder(model, "run"))
    except msgspec.ValidationError as exc:
        raise BadInput(f"Bad input: {exc}".replace("at `$", f"at `$.requests[{i}]")) from exc
    return QueuedRequest(input=msgspec.Raw(item), external_reference=reference)


async def submit(services: BatchServices, tenant: TenantContext, model: ModelSpec, raw: bytes) -> Response:
    """Queue a job (the body is already under the 10 MB limit) and answer its request id.

    A submit is a request: one against the tenant's requests per minute, refused (429, 3036) once
    the day's neurons are spent, as a poll is counted. And a tenant's kept jobs (requests and
    results, kept `batch_result_ttl_s`) are capped in bytes: a security review, 2026-12-07, had a
    tenant with no neurons left store 3.4 MB/s of results for 24 h (every item refused at admission,
    each refusal kept with its 1 KB `external_reference`)."""
    body = decode(raw, _submit_decoder)
    items = [_checked(r, i, model) for i, r in enumerate(body.requests)]
    limiter = services.inference.limiter
    no_tokens = replace(tenant, quotas=msgspec.structs.replace(tenant.quotas, tokens_per_minute=None))
    await limiter.settle(await limiter.admit(no_tokens, model.name, 0), tokens=0, neurons=0.0)
    s = services.settings
    cap, max_bytes = s.batch_max_pending_per_tenant, s.batch_max_stored_bytes_per_tenant
    job_id = await services.batch.queue.submit(
        tenant.tenant_id, model.name, msgspec.json.encode(items), len(items), max_pending=cap or None,
        max_stored_bytes=max_bytes or None,
    )  # fmt: skip
    if isinstance(job_id, Refused) and job_id.reason == "pending":
        raise RateLimited(
            f"Too many queued batch jobs: at most {cap} unfinished per account; poll them or wait "
            "for one to finish",
            retry_after=max(1, round(s.batch_poll_interval_s * 10)),
        )
    if isinstance(job_id, Refused):  # room comes back as kept results expire (then a purge)
        expiry = job_id.next_expiry
        wait_s = (expiry - now()).total_seconds() if expiry is not None else s.batch_result_ttl_s
        raise RateLimited(
            f"Too much kept by batch jobs: this account's jobs hold {job_id.stored_bytes} bytes of "
            f"requests and results, and this one would pass {max_bytes}; results are kept "
            f"{round(s.batch_result_ttl_s)} s after a job finishes",
            retry_after=max(1, round(wait_s + PURGE_INTERVAL_S)),
        )
    services.batch.wake()
    log.info(
        "batch_queued", request_id=job_id, tenant=tenant.tenant_id, model=model.name, num_requests=len(items)
    )
    status = BatchStatus(status="queued", request_id=job_id, model=model.name)
    return Response(msgspec.json.encode(Envelope(result=status, success=True)), media_type="application/json")


async def poll(services: BatchServices, tenant: TenantContext, model: ModelSpec, job_id: str) -> Response:
    """The job's state, or its results once done. Another tenant's job is as unknown as none.

    A poll is a request: it goes through the rate limiter (one request against the tenant's
    requests per minute, no tokens), so polling cannot read the database without bound. A spent
    daily neuron allowance or tokens-per-minute window does not stop a tenant from collecting the
    results it has paid for (a probe, 2026-12-07: a finished job's poll was a 429 "inference tokens
    per min rate reached" while the tenant's other work used the minute's tokens)."""
    limiter = services.inference.limiter
    quotas = msgspec.structs.replace(tenant.quotas, daily_neurons=None, tokens_per_minute=None)
    reads_only = replace(tenant, quotas=quotas)
    await limiter.settle(await limiter.admit(reads_only, model.name, 0), tokens=0, neurons=0.0)
    job = await services.batch.queue.get(job_id, tenant.tenant_id)
    if job is None or job.model != model.name:
        raise NotFound(f"No async batch request {job_id} for {model.name}")
    if job.status == DONE:
        assert job.responses is not None
        result: Any = msgspec.Raw(job.responses)
    else:
        result = BatchStatus(
            status="running" if job.status == "running" else "queued", request_id=job.id, model=job.model
        )
    return Response(msgspec.json.encode(Envelope(result=result, success=True)), media_type="application/json")


# ---- the worker's side ---------------------------------------------------------------------------------
class PriorityRouter(Router):
    """The app's router (same pools, same health) sending every request at `priority`."""

    def __init__(self, base: Router, priority: int) -> None:
        super().__init__(base.pools, base.client)
        self._priority = priority

    def generate(  # type: ignore[no-untyped-def]
        self,
        model: ModelSpec,
        request: b.GenerateRequest,
        *,
        affinity: str | None = None,
        dispatch: Dispatch | None = None,
    ):
        return super().generate(
            model,
            msgspec.structs.replace(request, priority=self._priority),
            affinity=affinity,
            dispatch=dispatch,
        )


class BatchWorker:
    """Runs queued jobs, one per gateway (on `Services`). It runs up to `batch_max_jobs` jobs at
    once, at most one per tenant, and their requests share `batch_concurrency` slots round-robin
    by tenant (`FairSlots`): a tenant's thousand-request job does not hold another tenant's
    one-request job back by more than one request, and a request waiting out a 429 holds no slot."""

    def __init__(self) -> None:
        self.worker_id = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self._queue: BatchQueue | None = None
        self._services: BatchServices | None = None
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None
        self._slots: FairSlots | None = None
        self._jobs: dict[asyncio.Task[None], str] = {}  # running jobs → their tenants
        self.num_jobs_done = 0

    @property
    def queue(self) -> BatchQueue:
        assert self._queue is not None, "BatchWorker.start() first"
        return self._queue

    async def start(self, services: BatchServices) -> None:
        self._services = services
        self._queue = BatchQueue(services.store.engine)
        self._wake = asyncio.Event()
        self._slots = FairSlots(services.settings.batch_concurrency)
        self._task = asyncio.create_task(self._loop(), name="kumo-batch")

    async def stop(self) -> None:
        """Stop taking jobs and hand every running one back, its answers kept. Returns once they are
        handed back (each within `HAND_BACK_TIMEOUT_S`), even when the caller is cancelled meanwhile
        (uvicorn giving up on the shutdown): the cancellation is raised then."""
        if self._task is not None:
            self._task.cancel()
            await _outlast_cancels(asyncio.gather(self._task, return_exceptions=True))
            self._task = None

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _loop(self) -> None:
        assert self._services is not None and self._wake is not None
        settings = self._services.settings
        loop = asyncio.get_running_loop()
        next_purge = loop.time()
        try:
            while not self._services.lifecycle.is_draining:
                self._wake.clear()
                job: BatchJob | None = None
                try:
                    if loop.time() >= next_purge:
                        num = await self.queue.purge()
                        if num:
                            log.info("batch_purged", num_jobs=num)
                        next_purge = loop.time() + PURGE_INTERVAL_S
                    if len(self._jobs) < settings.batch_max_jobs:
                        job = await self.queue.claim(
                            self.worker_id, settings.batch_lease_s, skip_tenants=set(self._jobs.values())
                        )
                except (SQLAlchemyError, OSError) as exc:
                    log.warning("batch_queue_unavailable", error=type(exc).__name__)
                if job is None:  # woken by a submit, a job ending, or the poll interval; not
                    # `wait_for`: on Python 3.11 it returns a wake-up that comes with a cancel and
                    # drops the cancel (the worker polled on; its stop waited forever)
                    with contextlib.suppress(TimeoutError):
                        async with asyncio.timeout(settings.batch_poll_interval_s):
                            await self._wake.wait()
                    continue
                task = asyncio.create_task(self._guarded(job), name=f"kumo-batch-{job.id}")
                self._jobs[task] = job.tenant_id
                task.add_done_callback(self._ended)
        except asyncio.CancelledError:  # this gateway is stopping: every job hands itself back
            for task in self._jobs:
                task.cancel()
            await _outlast_cancels(asyncio.gather(*self._jobs, return_exceptions=True))
            raise
        await asyncio.gather(*self._jobs, return_exceptions=True)  # draining: they hand back

    def _ended(self, task: asyncio.Task[None]) -> None:
        self._jobs.pop(task, None)
        self.wake()

    async def _guarded(self, job: BatchJob) -> None:
        try:
            await self._run(job)
        except (SQLAlchemyError, OSError) as exc:  # its lease runs out; it is retried
            log.warning("batch_queue_unavailable", request_id=job.id, error=type(exc).__name__)
        except Exception:  # a bug must not stop this gateway's queue; the job is retried, then failed
            log.exception("batch_failed", request_id=job.id)

    async def _run(self, job: BatchJob) -> None:
        """Run `job` while renewing its lease; hand it back if this gateway stops or drains."""
        assert self._services is not None
        settings, lifecycle = self._services.settings, self._services.lifecycle
        progress = Progress(job)
        log.info(
            "batch_started",
            request_id=job.id,
            attempt=job.attempts,
            num_requests=job.num_requests,
            num_answered=len(progress.answered),
        )
        work = asyncio.create_task(self._execute(job, progress))
        loop = asyncio.get_running_loop()
        renew_at = loop.time() + settings.batch_lease_s / 3
        try:
            while not work.done() and not lifecycle.is_draining:
                await asyncio.wait({work}, timeout=min(1.0, settings.batch_lease_s / 3))
                if not work.done() and loop.time() >= renew_at:
                    renew_at = loop.time() + settings.batch_lease_s / 3
                    new = progress.unwritten()  # a gateway that dies loses a lease's worth at most
                    if not await self.queue.renew(job.id, self.worker_id, settings.batch_lease_s, new):
                        log.warning("batch_lease_lost", request_id=job.id)
                        await _cancel(work)
                        return
                    progress.written(new)
                    if await self.queue.is_suspended(job.tenant_id):  # it waits for the resume
                        log.info("batch_held", request_id=job.id, reason="tenant_suspended")
                        await self._hand_back(job, work, progress, is_attempt=False)
                        return
        except BaseException:  # this gateway is stopping, or the store failed a renewal: no orphan
            await self._hand_back(job, work, progress)  # work left running unowned, billing twice
            raise
        if not work.done():  # draining: another gateway takes the job over now
            await self._hand_back(job, work, progress)
            return
        # the result stored however often a shutdown cancels meanwhile (cut short, the job stayed
        # leased and ran, and billed, again once its lease ran out); the store bounds its own time
        storing = asyncio.create_task(
            self.queue.finish(job.id, self.worker_id, work.result(), settings.batch_result_ttl_s)
        )
        await _outlast_cancels(storing)
        finished = storing.result()
        self.num_jobs_done += finished
        log.info("batch_done", request_id=job.id, stored=finished)

    async def _hand_back(
        self, job: BatchJob, work: asyncio.Task[bytes], progress: Progress, *, is_attempt: bool = True
    ) -> None:
        """Cancel the job's requests in flight and hand it back with its answers. This runs to its
        end however often this task is cancelled meanwhile (a shutdown may cancel it twice: the
        worker's stop and the lifespan's, or uvicorn's timeout): cut short, it left the job leased and
        its answers unkept, to be run and billed again."""
        await _outlast_cancels(asyncio.create_task(self._release(job, work, progress, is_attempt)))

    async def _release(
        self, job: BatchJob, work: asyncio.Task[bytes], progress: Progress, is_attempt: bool
    ) -> None:
        if not await _cancel(work):
            log.warning("batch_requests_outlived_cancel", request_id=job.id)
        try:
            async with asyncio.timeout(HAND_BACK_TIMEOUT_S):
                await self.queue.release(job.id, self.worker_id, progress.unwritten(), is_attempt=is_attempt)
        except (SQLAlchemyError, OSError, TimeoutError) as exc:  # its lease runs out; it is retried
            log.warning("batch_release_failed", request_id=job.id, error=type(exc).__name__)
            return
        log.info("batch_released", request_id=job.id, num_answered=len(progress.answered))

    async def _execute(self, job: BatchJob, progress: Progress) -> bytes:
        """Every request of the job not answered yet (earlier attempts kept some), a few at a
        time, each added to `progress` as it ends for good; the encoded `BatchDone` of them all."""
        services = self._services
        assert services is not None and job.requests is not None
        items = _stored.decode(job.requests)
        answered = progress.answered
        try:
            if job.attempts > MAX_ATTEMPTS:
                raise KumoError("Unknown internal error")
            tenant = await _tenant(services, job.tenant_id)
            inference = services.inference
            inference = replace(
                inference, router=PriorityRouter(inference.router, services.settings.batch_priority)
            )
        except KumoError as exc:
            failed = {i: Answered(i, _failure(i, item, exc), 0, 0) for i, item in enumerate(items)}
            return _done(failed | answered)
        slots = self._slots
        assert slots is not None
        results = dict(answered)

        async def one(i: int, item: QueuedRequest) -> None:
            result, prompt, completion, is_final = await _run_one(
                inference, slots, tenant, job.model, i, item
            )
            results[i] = Answered(i, result, prompt, completion)
            if is_final:  # a failure that may pass (a timeout, no capacity) is tried again on take-over
                progress.add(results[i])

        await asyncio.gather(*(one(i, item) for i, item in enumerate(items) if i not in answered))
        return _done(results)


def is_final(exc: KumoError) -> bool:
    """A request's failure that another attempt would meet again: a refusal of the request itself
    (a 4xx, but a timeout, or a 429 worth retrying). The others (no capacity, a timeout, an internal
    error) are not kept in a job's progress: the gateway that takes the job over tries them again."""
    return 400 <= exc.status < 500 and exc.status != 408 and (exc.status != 429 or not exc.can_retry)


def _done(answered: dict[int, Answered]) -> bytes:
    """The encoded `BatchDone`: every request's item in order, and the usage of them all."""
    ordered = [answered[i] for i in sorted(answered)]
    prompt = sum(a.prompt_tokens for a in ordered)
    completion = sum(a.completion_tokens for a in ordered)
    usage = BatchUsage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)
    return msgspec.json.encode(BatchDone(responses=[a.item for a in ordered], usage=usage))


async def _cancel(work: asyncio.Task[bytes]) -> bool:
    """Cancel a job's requests, once (a second cancel would cut their own clean-up short: the
    billing of what was computed), and wait for them, at most `HAND_BACK_TIMEOUT_S`; whether they ended."""
    if not work.cancelling():
        work.cancel()
    done, _ = await asyncio.wait({work}, timeout=HAND_BACK_TIMEOUT_S)
    if done and not work.cancelled() and (exc := work.exception()) is not None:
        log.warning("batch_requests_failed", error=repr(exc))
    return bool(done)


async def _outlast_cancels(future: asyncio.Future[Any]) -> None:
    """Wait until `future` is done, without cancelling it, however often this task is cancelled
    meanwhile; then raise the cancellation, if any. (`asyncio.shield` gives up at the first cancel
    and leaves `future` running unawaited, while the shutdown goes on and closes the store under it.)
    `future` must bound its own time."""
    is_cancelled = False
    while not future.done():
        try:
            await asyncio.wait({future})
        except asyncio.CancelledError:
            is_cancelled = True
    try:
        future.result()  # its failure goes on, as the cancellation's context if there is one
    finally:
        if is_cancelled:
            raise asyncio.CancelledError


async def _tenant(services: BatchServices, tenant_id: str) -> TenantContext:
    """The job's tenant as it is now (a tenant deleted since is NotFound, its quotas current)."""
    t = await services.store.get_tenant(tenant_id)
    allowed = None if t.models.allow is None else frozenset(t.models.allow)
    return TenantContext(
        tenant_id=t.id, name=t.name, plan=t.plan, allowed_models=allowed, token_id="batch", quotas=t.quotas
    )


def _failure(i: int, item: QueuedRequest, exc: KumoError) -> BatchItem:
    return BatchItem(
        id=i,
        result=None,
        success=False,
        external_reference=item.external_reference,
        errors=[ErrorItem(code=exc.code, message=exc.wire_message)],
    )


async def _run_one(
    inference: InferenceService,
    slots: FairSlots,
    tenant: TenantContext,
    model_name: str,
    i: int,
    item: QueuedRequest,
) -> tuple[BatchItem, int, int, bool]:
    """One queued request through the service `/ai/run` calls, in one of the shared slots once it
    is the tenant's turn; waits out 429/503 (but a spent daily allowance) as often as
    `MAX_ITEM_RETRIES`, without holding a slot. Returns the item, its prompt/completion tokens and
    whether the outcome is final (an answer, or a refusal of the request itself: a 4xx but 408/429)."""
    raw = bytes(item.input)
    for attempt in range(MAX_ITEM_RETRIES + 1):
        meta = CallMeta()  # each attempt has its own request id; no affinity, the default deadline
        try:
            async with slots.slot(tenant.tenant_id):
                model = inference.resolve_model(tenant, model_name, meta.info)
                prompt = Prompt(decode(raw, input_decoder(model, "run")), raw)
                answer = await inference.run(tenant, model, prompt, "run", meta)
        except (RateLimited, Busy, Unavailable) as exc:
            if attempt == MAX_ITEM_RETRIES:
                return _failure(i, item, exc), 0, 0, False
            await asyncio.sleep(min(exc.retry_after or 1, 30))
            continue
        except KumoError as exc:
            return _failure(i, item, exc), 0, 0, is_final(exc)
        assert isinstance(answer, Answer), "queued requests are stored without `stream`"
        result = BatchItem(id=i, result=answer.body, success=True, external_reference=item.external_reference)
        return result, meta.info.prompt_tokens, meta.info.completion_tokens, True
    raise AssertionError("unreachable")

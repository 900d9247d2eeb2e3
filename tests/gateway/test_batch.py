# ruff: noqa: F811  (pytest fixtures imported by name)
"""Async batch (reference §1.6) through the gateway, and the store's queue on SQLite and PostgreSQL:
each job taken by exactly one worker, taken over when its worker's lease expires, kept for a while."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as dt
import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from alembic import command
from gateway_harness import GLM, LEGACY, Harness, _tenant, harness  # noqa: F401  (fixture)
from sqlalchemy import delete, event, func, insert, select, text, update
from sqlalchemy.ext.asyncio import create_async_engine
from tenancy_db import DIALECTS, create_database, drop_database, store_fixture  # noqa: F401  (fixture)

from gateway.batch import MAX_ATTEMPTS, BatchWorker
from gateway.store import Store
from gateway.store.batch import DONE, QUEUED, RUNNING, BatchJob, BatchQueue, KeptAnswer, Refused
from gateway.store.migrate import alembic_config
from gateway.store.tables import BatchAnswerRow, BatchJobRow
from schemas.admin import Quotas, TenantPatch


async def wait_done(
    harness: Harness,
    model: str,
    job_id: str,
    timeout_s: float = 20,
    *,
    envelope: bool = False,
    account: str | None = None,
    token: str | None = None,
) -> dict:  # type: ignore[type-arg]
    """Poll until done, on `/ai/run/{model}` or (`envelope`) on `/ai/run` with `{model, input}`, as
    the harness's tenant or `account` with its `token`."""
    seen = set()
    poll = {"request_id": job_id}
    for _ in range(int(timeout_s / 0.05)):
        r = await harness.http.post(
            harness.path("/ai/run" if envelope else f"/ai/run/{model}", account),
            headers=harness.auth(token),
            json={"model": model, "input": poll} if envelope else poll,
        )
        assert r.status_code == 200, r.text
        result = r.json()["result"]
        if "responses" in result:
            return result
        assert result["status"] in ("queued", "running") and result["request_id"] == job_id
        seen.add(result["status"])
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} not done; seen {seen}")


async def job_once(
    harness: Harness, job_id: str, account: str, status: str, timeout_s: float = 5
) -> BatchJob:
    """The job, read from the store until it is in `status` (`timeout_s` at most)."""
    for _ in range(int(timeout_s / 0.05)):
        job = await harness.services.batch.queue.get(job_id, account)
        if job is not None and job.status == status:
            return job
        await asyncio.sleep(0.05)
    raise AssertionError(f"job {job_id} not {status}: {job}")


async def test_submit_poll_and_results_with_references(harness: Harness) -> None:
    body = {
        "requests": [
            {"prompt": "first", "external_reference": "ref-1"},
            {
                "messages": [{"role": "user", "content": "second"}],
                "external_reference": "ref-2",
                "stream": True,
            },
            {"prompt": "third"},
        ]
    }
    before = len(harness.journal)
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}?queueRequest=true"), headers=harness.auth(), json=body
    )
    assert r.status_code == 200, r.text
    envelope = r.json()
    assert envelope["success"] is True and envelope["errors"] == [] and envelope["messages"] == []
    queued = envelope["result"]
    assert queued["status"] == "queued" and queued["model"] == LEGACY and len(queued["request_id"]) == 36
    result = await wait_done(harness, LEGACY, queued["request_id"])
    responses = result["responses"]
    assert [x["id"] for x in responses] == [0, 1, 2]
    assert [x["external_reference"] for x in responses] == ["ref-1", "ref-2", None]
    assert all(x["success"] for x in responses)
    assert [x["result"]["response"] for x in responses] == ["echo: first", "echo: second", "echo: third"]
    prompt = sum(x["result"]["usage"]["prompt_tokens"] for x in responses)
    completion = sum(x["result"]["usage"]["completion_tokens"] for x in responses)
    assert result["usage"] == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }
    sent = harness.journal[before:]
    assert len(sent) == 3 and all(req.priority == harness.services.settings.batch_priority for req in sent)
    # interactive requests keep priority 0
    await harness.http.post(harness.path(f"/ai/run/{LEGACY}"), headers=harness.auth(), json={"prompt": "now"})
    assert harness.last.priority == 0


async def test_the_model_input_envelope_queues_and_polls_too(harness: Harness) -> None:
    """`POST …/ai/run?queueRequest=true` with `{model, input: {requests}}` queues like the model
    path does, and `{model, input: {request_id}}` polls; a job polled as another model is unknown."""
    body = {"model": GLM, "input": {"requests": [{"prompt": "one", "external_reference": "a"}]}}
    r = await harness.http.post(harness.path("/ai/run?queueRequest=true"), headers=harness.auth(), json=body)
    assert r.status_code == 200, r.text
    queued = r.json()["result"]
    assert queued["status"] == "queued" and queued["model"] == GLM
    result = await wait_done(harness, GLM, queued["request_id"], envelope=True)
    [item] = result["responses"]
    assert item["external_reference"] == "a" and item["success"] is True
    assert item["result"]["choices"][0]["message"]["content"] == "echo: one"
    wrong = {"model": LEGACY, "input": {"request_id": queued["request_id"]}}
    r = await harness.http.post(harness.path("/ai/run"), headers=harness.auth(), json=wrong)
    assert r.status_code == 404, r.text
    # queueRequest with a body that is not a batch is a 400, as on the model path
    r = await harness.http.post(
        harness.path("/ai/run?queueRequest=true"),
        headers=harness.auth(),
        json={"model": GLM, "input": {"prompt": "x"}},
    )
    assert r.status_code == 400 and r.json()["errors"][0]["message"].startswith("AiError: Bad input")


async def test_openai_family_results_and_failures_per_request(harness: Harness) -> None:
    body = {
        "requests": [
            {"messages": [{"role": "user", "content": "hi"}]},
            {"messages": [{"role": "user", "content": "overflow"}]},
        ]
    }
    r = await harness.http.post(
        harness.path(f"/ai/run/{GLM}?queueRequest=true"), headers=harness.auth(), json=body
    )
    result = await wait_done(harness, GLM, r.json()["result"]["request_id"])
    ok, failed = result["responses"]
    assert ok["success"] and ok["result"]["choices"][0]["message"]["content"] == "echo: hi"
    assert not failed["success"] and failed["result"] is None and failed["errors"][0]["code"] == 5021


async def test_submit_is_validated_whole_before_queueing(harness: Harness) -> None:
    url = harness.path(f"/ai/run/{LEGACY}?queueRequest=true")
    r = await harness.http.post(
        url,
        headers=harness.auth(),
        json={"requests": [{"prompt": "ok"}, {"prompt": "x", "max_tokens": "many"}]},
    )
    assert r.status_code == 400 and "$.requests[1].max_tokens" in r.json()["errors"][0]["message"], r.text
    for bad in (
        {"requests": []},
        {"requests": [1]},
        {"prompt": "not a batch"},
        {"requests": [{"prompt": "x", "external_reference": 5}]},
    ):
        r = await harness.http.post(url, headers=harness.auth(), json=bad)
        assert r.status_code == 400 and r.json()["success"] is False, (bad, r.text)


async def test_a_job_is_only_its_tenants(harness: Harness) -> None:
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}?queueRequest=true"),
        headers=harness.auth(),
        json={"requests": [{"prompt": "mine"}]},
    )
    job_id = r.json()["result"]["request_id"]
    other = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}", harness.limited_account),
        headers=harness.auth(harness.limited_token),
        json={"request_id": job_id},
    )
    assert other.status_code == 404 and other.json()["result"] is None
    wrong_model = await harness.http.post(
        harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json={"request_id": job_id}
    )
    assert wrong_model.status_code == 404
    unknown = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}"), headers=harness.auth(), json={"request_id": "nope"}
    )
    assert unknown.status_code == 404
    await wait_done(harness, LEGACY, job_id)


# ---- the queue in the store ------------------------------------------------------------------------------
async def test_each_job_is_claimed_by_exactly_one_worker(store: Store) -> None:
    queues = [BatchQueue(store.engine) for _ in range(4)]
    ids = {await queues[0].submit("t" * 32, "m", b"[]", 0) for _ in range(12)}
    claims = await asyncio.gather(*(queues[i % 4].claim(f"w{i}", 60) for i in range(20)))
    taken = [c.id for c in claims if c is not None]
    assert sorted(taken) == sorted(ids)  # every job once, none twice
    assert await queues[0].claim("late", 60) is None


async def test_an_expired_lease_is_taken_over_and_the_old_worker_cannot_finish(store: Store) -> None:
    queue = BatchQueue(store.engine)
    job_id = await queue.submit("a" * 32, "m", b"[]", 0)
    while (first := await queue.claim("dead", 60)) is not None and first.id != job_id:
        await queue.finish(first.id, "dead", b"{}", 60)  # jobs left by the previous test
    assert first is not None and first.attempts == 1
    assert await queue.claim("other", 60) is None  # leased
    async with store.engine.begin() as c:  # time passes: the lease runs out
        past = dt.datetime.now(dt.UTC) - dt.timedelta(seconds=1)
        await c.execute(update(BatchJobRow).where(BatchJobRow.id == job_id).values(lease_expires_at=past))
    second = await queue.claim("other", 60)
    assert second is not None and second.id == job_id and second.attempts == 2
    assert not await queue.renew(job_id, "dead", 60) and not await queue.finish(job_id, "dead", b"{}", 60)
    assert await queue.renew(job_id, "other", 60)
    assert await queue.finish(job_id, "other", b'{"responses":[]}', 60)
    job = await queue.get(job_id, "a" * 32)
    assert job is not None and job.status == DONE and job.responses == b'{"responses":[]}'
    assert await queue.get(job_id, "b" * 32) is None  # another tenant


async def test_released_jobs_go_back_and_results_expire(store: Store) -> None:
    queue = BatchQueue(store.engine)
    job_id = await queue.submit("c" * 32, "m", b"[1]", 1)
    claimed = None
    while (claimed := await queue.claim("w", 60)) is not None and claimed.id != job_id:
        await queue.finish(claimed.id, "w", b"{}", 60)
    assert claimed is not None and claimed.requests == b"[1]"
    await queue.release(job_id, "w")
    job = await queue.get(job_id, "c" * 32)
    assert job is not None and job.status == QUEUED
    again = await queue.claim("w2", 60)
    assert again is not None and again.id == job_id and again.status == RUNNING
    assert await queue.finish(job_id, "w2", b"{}", 0)
    assert await queue.get(job_id, "c" * 32) is None  # kept 0 s
    assert await queue.purge() >= 1


async def test_a_jobs_answers_are_kept_with_its_lease_and_dropped_when_it_finishes(store: Store) -> None:
    """Each renewal and the hand-back add the answers given since (written again after a renewal
    whose commit was cut short, they stay as first written); a worker that lost the job keeps none;
    the next holder gets them all with the job; the result replaces them."""
    queue = BatchQueue(store.engine)
    job_id = await queue.submit("d" * 32, "m", b"[1,2,3]", 3)
    claimed = None
    while (claimed := await queue.claim("w", 60)) is not None and claimed.id != job_id:
        await queue.finish(claimed.id, "w", b"{}", 60)
    assert claimed is not None and claimed.answers == ()
    first, second, third = (KeptAnswer(i, b'{"id":%d}' % i, 10 + i, 20 + i) for i in range(3))
    assert await queue.renew(job_id, "w", 60, [first])
    assert await queue.renew(job_id, "w", 60, [first, second])  # `first` again: kept as it was
    assert not await queue.renew(job_id, "not-w", 60, [third])  # not its job: nothing kept
    await queue.release(job_id, "not-w", [third])
    await queue.release(job_id, "w", [third])
    again = await queue.claim("w2", 60)
    assert again is not None and again.id == job_id
    assert sorted(again.answers, key=lambda a: a.index) == [first, second, third]
    assert await queue.finish(job_id, "w2", b"{}", 60)
    async with store.engine.connect() as c:
        left = await c.scalar(
            select(func.count()).select_from(BatchAnswerRow).where(BatchAnswerRow.job_id == job_id)
        )
    assert left == 0


@pytest.mark.parametrize("kind", DIALECTS)
async def test_answers_kept_by_revision_0005_survive_the_upgrade(kind: str, tmp_path: Path) -> None:
    """A job handed back before the upgrade kept its answers in `batch_jobs.progress`: after it,
    the gateway that takes the job gets them (and runs only the rest); a downgrade puts them back."""
    url, name = await create_database(kind, tmp_path)
    engine = create_async_engine(url)
    old_progress = [
        {"index": 2, "item": {"id": 2, "result": {"response": "two"}, "success": True}, "prompt_tokens": 3,
         "completion_tokens": 4},
        {"index": 0, "item": {"id": 0, "result": None, "success": False, "errors": [{"code": 5021,
         "message": "too long"}]}, "prompt_tokens": 0, "completion_tokens": 0},
        {"index": 9, "item": {"id": 9, "result": None, "success": True}, "prompt_tokens": 1,
         "completion_tokens": 1},  # past the job's end: dropped, as the worker did
    ]  # fmt: skip
    jobs = {"kept": json.dumps(old_progress).encode(), "unreadable": b"[{", "none": None}
    try:
        async with engine.begin() as c:
            await c.run_sync(lambda sync: command.upgrade(alembic_config(sync), "0005"))
            for tenant, progress in jobs.items():
                await c.execute(
                    text(
                        "INSERT INTO batch_jobs (id, tenant_id, model, status, requests, num_requests, attempts,"
                        " created_at, progress) VALUES (:id, :tenant, 'm', 'queued', :requests, 3, 1, :at,"
                        " :progress)"
                    ),
                    {"id": str(uuid.uuid4()), "tenant": tenant, "requests": b"[1,2,3]", "at": dt.datetime(2026, 1, 1),
                     "progress": progress},
                )  # fmt: skip
        store = Store()
        await store.open(url)  # migrates to head
        try:
            async with store.engine.connect() as c:  # the column stays, emptied: older gateways use it
                assert (await c.execute(text("SELECT progress FROM batch_jobs"))).scalars().all() == [
                    None
                ] * 3
            queue = BatchQueue(store.engine)
            claimed = {}
            while (job := await queue.claim("w", 60)) is not None:
                claimed[job.tenant_id] = job
        finally:
            await store.close()
        assert set(claimed) == set(jobs)
        assert claimed["unreadable"].answers == () and claimed["none"].answers == ()
        kept = sorted(claimed["kept"].answers, key=lambda a: a.index)
        assert [(a.index, json.loads(a.item), a.prompt_tokens, a.completion_tokens) for a in kept] == [
            (0, old_progress[1]["item"], 0, 0),
            (2, old_progress[0]["item"], 3, 4),
        ]
        async with engine.begin() as c:
            await c.run_sync(lambda sync: command.downgrade(alembic_config(sync), "0005"))
            progress = await c.scalar(text("SELECT progress FROM batch_jobs WHERE tenant_id = 'kept'"))
        assert json.loads(progress) == sorted(old_progress[:2], key=lambda a: a["index"])
    finally:
        await engine.dispose()
        await drop_database(name)


@pytest.mark.parametrize("kind", DIALECTS)
async def test_a_gateway_of_the_release_before_keeps_working_after_the_upgrade(
    kind: str, tmp_path: Path
) -> None:
    """A rolling upgrade: once a new gateway has migrated the shared database, one of the release
    before (revision 0005's queries: `progress` read and written whole) still polls, renews and
    finishes; and a job it handed back with answers in `progress` is taken over by a new gateway
    with those answers (it runs only the rest)."""
    url, name = await create_database(kind, tmp_path)
    store = Store()
    try:
        await store.open(url)  # head
        queue = BatchQueue(store.engine)
        job_id = await queue.submit("t", "m", b"[1,2,3]", 3)
        old_progress = [{"index": 1, "item": {"id": 1, "result": {"response": "one"}, "success": True},
                         "prompt_tokens": 5, "completion_tokens": 6}]  # fmt: skip
        async with store.engine.begin() as c:  # the older gateway's claim, renewal with progress, hand-back
            await c.execute(
                text(
                    "UPDATE batch_jobs SET status = 'running', claimed_by = 'old', progress = :p WHERE id = :id"
                ),
                {"p": json.dumps(old_progress).encode(), "id": job_id},
            )
            got = await c.execute(
                text("SELECT progress, status FROM batch_jobs WHERE id = :id"), {"id": job_id}
            )
            assert got.one()[1] == "running"
            await c.execute(
                text("UPDATE batch_jobs SET status = 'queued', claimed_by = NULL WHERE id = :id"),
                {"id": job_id},
            )
        job = await queue.claim("new", 60)
        assert job is not None and job.id == job_id
        assert [(a.index, json.loads(a.item), a.prompt_tokens) for a in job.answers] == [
            (1, old_progress[0]["item"], 5)
        ]
        assert await queue.finish(job_id, "new", b"[]", 60)
        async with store.engine.connect() as c:
            progress = await c.scalar(text("SELECT progress FROM batch_jobs WHERE id = :id"), {"id": job_id})
        assert progress is None
    finally:
        await store.close()
        await drop_database(name)


async def test_a_stopping_gateway_hands_its_job_to_another(harness: Harness) -> None:
    """Worker A takes a job of slow requests and stops mid-job (a gateway restart): the job goes
    back to the queue, and the other worker runs it to the end."""
    services = harness.services
    await services.batch.stop()  # only A may take the job at first
    other = BatchWorker()
    try:
        body = {
            "requests": [
                {"messages": [{"role": "user", "content": "slow"}], "external_reference": str(i)}
                for i in range(3)
            ]
        }
        r = await harness.http.post(
            harness.path(f"/ai/run/{GLM}?queueRequest=true"), headers=harness.auth(), json=body
        )
        job_id = r.json()["result"]["request_id"]
        await other.start(services)
        await job_once(harness, job_id, harness.account, RUNNING)
        await asyncio.sleep(0.3)  # its requests are under way
        await other.stop()
        job = await services.batch.queue.get(job_id, harness.account)
        assert job is not None and job.status == QUEUED and job.attempts == 1
    finally:
        await other.stop()
        await services.batch.start(services)
    result = await wait_done(harness, GLM, job_id)
    assert [x["external_reference"] for x in result["responses"]] == ["0", "1", "2"]
    assert all(x["success"] for x in result["responses"])
    job = await services.batch.queue.get(job_id, harness.account)
    assert job is not None and job.attempts == 2 and other.num_jobs_done == 0


async def billed_glm(harness: Harness) -> tuple[int, int]:
    """(requests, completion tokens) in the usage ledger today for GLM."""
    await harness.services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    rows = await harness.services.store.usage(harness.account, since=today, until=today, group_by="model")
    return next(((r.requests, r.completion_tokens) for r in rows if r.model == GLM), (0, 0))


async def submit_fast_and_slow(harness: Harness) -> str:
    """A GLM batch job of a fast request, then a slow one (~0.3 s a piece): its id."""
    body = {
        "requests": [
            {"messages": [{"role": "user", "content": "fast"}], "external_reference": "fast"},
            {"messages": [{"role": "user", "content": "slow"}], "external_reference": "slow"},
        ]
    }
    r = await harness.http.post(
        harness.path(f"/ai/run/{GLM}?queueRequest=true"), headers=harness.auth(), json=body
    )
    return str(r.json()["result"]["request_id"])


async def until_billed(harness: Harness, before: tuple[int, int]) -> None:
    """Wait (5 s at most) until the ledger has billed a GLM request more than `before`."""
    for _ in range(100):
        if (await billed_glm(harness))[0] > before[0]:
            return
        await asyncio.sleep(0.05)


async def test_a_job_handed_back_runs_only_what_was_not_answered(harness: Harness) -> None:
    """A job of one fast and one slow request is handed back once the fast one is answered (and
    billed): the gateway that takes it over runs only the slow one, and the job's usage is what the
    ledger billed (it once ran and billed the whole job again)."""
    services = harness.services
    await services.batch.stop()  # only the other worker may take the job at first
    other = BatchWorker()
    before = await billed_glm(harness)
    try:
        job_id = await submit_fast_and_slow(harness)
        await other.start(services)
        await until_billed(harness, before)  # "fast" answered and billed
        await other.stop()  # "slow" is still under way (~0.3 s a piece)
        job = await services.batch.queue.get(job_id, harness.account)
        assert job is not None and job.status == QUEUED
    finally:
        await other.stop()
        await services.batch.start(services)
    glm = harness.backends["glm-5.2"]
    num_fast = sum(1 for b in glm for req in b.requests if req.messages[-1].content == "fast")
    result = await wait_done(harness, GLM, job_id)
    assert [x["external_reference"] for x in result["responses"]] == ["fast", "slow"]
    assert all(x["success"] for x in result["responses"])
    after = await billed_glm(harness)
    # billed: "fast" once, "slow" cut short once (what it had computed) and once whole
    assert after[0] - before[0] == 3
    assert (
        sum(1 for req in harness.backends["glm-5.2"][0].requests if req.messages[-1].content == "fast")
        == num_fast
    )
    assert result["usage"]["completion_tokens"] <= after[1] - before[1]


@pytest.mark.parametrize("second_cancel", ["the worker's task", "stop's caller"])
async def test_a_second_cancel_does_not_cut_the_hand_back_short(harness: Harness, second_cancel: str) -> None:
    """The gateway stops while a job's first request is answered (and billed) and its second is under
    way, and the stopping worker is cancelled a second time while it hands the job back (the lifespan
    cancelling the worker's task too, or uvicorn giving up on the shutdown): the hand-back still ends,
    its requests in flight cancelled and the answered one kept, so the gateway that takes the job over
    runs only the rest (a second cancel once left the job leased, its answer lost and billed again)."""
    services = harness.services
    await services.batch.stop()
    other = BatchWorker()
    before = await billed_glm(harness)
    try:
        job_id = await submit_fast_and_slow(harness)
        await other.start(services)
        release = other.queue.release

        async def slow_release(*args: Any, **kwargs: Any) -> None:  # a database slow to answer
            await asyncio.sleep(0.3)
            await release(*args, **kwargs)

        other.queue.release = slow_release  # type: ignore[method-assign]
        await until_billed(harness, before)  # "fast" answered and billed
        worker_task = other._task
        assert worker_task is not None
        stopping = asyncio.create_task(other.stop())
        await asyncio.sleep(0.1)  # handing the job back
        (worker_task if second_cancel == "the worker's task" else stopping).cancel()
        await asyncio.gather(stopping, return_exceptions=True)
        assert worker_task.done()
        running = [t for t in asyncio.all_tasks() if "_execute" in repr(t.get_coro()) and not t.done()]
        assert not running  # the requests in flight were cancelled, and awaited
        job = await services.batch.queue.get(job_id, harness.account)
        assert job is not None and job.status == QUEUED
    finally:
        await other.stop()
        await services.batch.start(services)
    glm = harness.backends["glm-5.2"]
    num_fast = sum(1 for b in glm for req in b.requests if req.messages[-1].content == "fast")
    result = await wait_done(harness, GLM, job_id)
    assert [x["external_reference"] for x in result["responses"]] == ["fast", "slow"]
    assert sum(1 for b in glm for req in b.requests if req.messages[-1].content == "fast") == num_fast


async def test_a_stop_while_the_result_is_stored_does_not_leave_the_job_leased(harness: Harness) -> None:
    """The gateway stops while a finished job's result is being stored (a slow database): the store
    still completes, so the job is done, not left running until its lease expires and then run (and
    billed) again by another gateway."""
    services = harness.services
    await services.batch.stop()
    other = BatchWorker()
    try:
        await other.start(services)
        storing = asyncio.Event()
        finish = other.queue.finish

        async def slow_finish(*args: Any, **kwargs: Any) -> bool:  # a database slow to answer
            storing.set()
            await asyncio.sleep(0.3)
            return await finish(*args, **kwargs)

        other.queue.finish = slow_finish  # type: ignore[method-assign]
        body = {"requests": [{"messages": [{"role": "user", "content": "fast"}], "external_reference": "a"}]}
        r = await harness.http.post(
            harness.path(f"/ai/run/{GLM}?queueRequest=true"), headers=harness.auth(), json=body
        )
        job_id = r.json()["result"]["request_id"]
        other.wake()
        await asyncio.wait_for(storing.wait(), 10)
        await other.stop()
        job = await services.batch.queue.get(job_id, harness.account)
        assert job is not None and job.status == DONE
    finally:
        await other.stop()
        await services.batch.start(services)


async def test_each_renewal_writes_only_what_was_answered_since_the_last(harness: Harness) -> None:
    """A job's answered requests are kept with its lease renewals (every `batch_lease_s / 3`): each
    renewal writes the answers that came since the one before, so the bytes written over a job's
    life stay those of its answers, once (it once rewrote them all each time: quadratic in the job)."""
    services = harness.services
    await services.batch.stop()
    settings = services.settings
    services.settings = dataclasses.replace(settings, batch_lease_s=0.15, batch_concurrency=1)
    written: list[int] = []  # bytes of answers written, per statement

    def count(conn: Any, cursor: Any, statement: str, parameters: Any, context: Any, many: bool) -> None:
        sql = " ".join(statement.split()).lower()
        if "responses" in sql or not sql.startswith(("insert into batch_answers", "update batch_jobs")):
            return  # not a renewal nor a hand-back (`finish` writes the result, once)
        rows = parameters if many else [parameters]
        blobs = [
            p
            for row in rows
            for p in (row.values() if isinstance(row, dict) else row)
            if isinstance(p, bytes | bytearray | memoryview)
        ]
        if blobs:
            written.append(sum(len(p) for p in blobs))

    engine = services.store.engine.sync_engine
    event.listen(engine, "before_cursor_execute", count)
    other = BatchWorker()
    try:
        num_requests = 200  # 10 ms each (`pause:`): ~2 s, a dozen renewals however fast the host
        body = {"requests": [{"prompt": f"pause: item {i} " + "x" * 200} for i in range(num_requests)]}
        r = await harness.http.post(
            harness.path(f"/ai/run/{LEGACY}?queueRequest=true"), headers=harness.auth(), json=body
        )
        job_id = r.json()["result"]["request_id"]
        await other.start(services)
        result = await wait_done(harness, LEGACY, job_id, timeout_s=60)
    finally:
        event.remove(engine, "before_cursor_execute", count)
        services.settings = settings
        await other.stop()
        await services.batch.start(services)
    assert len(result["responses"]) == num_requests and all(x["success"] for x in result["responses"])
    answers = sum(len(json.dumps(x, separators=(",", ":"))) for x in result["responses"])
    assert len(written) >= 3, written  # the job outlasted a few renewals
    assert sum(written) <= 1.2 * answers, (sum(written), answers, written)
    assert max(written) <= answers / 2, (answers, written)  # the last renewals no bigger than the first


async def test_a_job_whose_gateways_keep_dying_is_failed_not_retried_forever(harness: Harness) -> None:
    services = harness.services
    await services.batch.stop()
    try:
        body = {"requests": [{"prompt": "doomed", "external_reference": "x"}]}
        r = await harness.http.post(
            harness.path(f"/ai/run/{LEGACY}?queueRequest=true"), headers=harness.auth(), json=body
        )
        job_id = r.json()["result"]["request_id"]
        async with services.store.engine.begin() as c:  # as if MAX_ATTEMPTS gateways had taken it and died
            await c.execute(update(BatchJobRow).where(BatchJobRow.id == job_id).values(attempts=MAX_ATTEMPTS))
    finally:
        await services.batch.start(services)
    result = await wait_done(harness, LEGACY, job_id)
    [item] = result["responses"]
    assert not item["success"] and item["external_reference"] == "x" and item["errors"][0]["code"] == 3000


async def test_a_poll_for_a_malformed_id_is_unknown_on_every_database(store: Store) -> None:
    """A poll's `request_id` comes from the client: one that is not a job id (a NUL, which
    PostgreSQL cannot even compare) finds nothing instead of failing the query."""
    queue = BatchQueue(store.engine)
    job_id = await queue.submit("0" * 32, GLM, b"[]", 0)
    assert (await queue.get(job_id, "0" * 32)) is not None
    for bad in ("a\u0000b", job_id.upper() + "\u0000", "x" * 64):
        assert await queue.get(bad, "0" * 32) is None


async def test_an_account_with_too_many_unfinished_jobs_is_told_to_wait(harness: Harness) -> None:
    """One account cannot fill the shared queue: past `batch_max_pending_per_tenant` unfinished
    (queued or running) jobs, a submit is a 429 with Retry-After; once one finishes, it is accepted."""
    services = harness.services
    account, token = await _tenant(services, "batch-cap", "paid")
    async with services.store.engine.begin() as c:  # two jobs another gateway is running right now
        for n in range(2):
            await c.execute(
                insert(BatchJobRow).values(
                    id=str(uuid.uuid4()), tenant_id=account, model=LEGACY, status=RUNNING, requests=b"[]",
                    num_requests=0, attempts=1, claimed_by=f"elsewhere-{n}", created_at=dt.datetime.now(dt.UTC),
                    lease_expires_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1),
                )
            )  # fmt: skip
    settings = services.settings
    services.settings = dataclasses.replace(settings, batch_max_pending_per_tenant=2)
    try:
        url = harness.path(f"/ai/run/{LEGACY}?queueRequest=true", account)
        body = {"requests": [{"prompt": "one more"}]}
        r = await harness.http.post(url, headers=harness.auth(token), json=body)
        assert r.status_code == 429, r.text
        assert (
            r.json()["errors"][0]["code"] == 3021
            and "at most 2 unfinished" in r.json()["errors"][0]["message"]
        )
        assert int(r.headers["retry-after"]) >= 1
        async with services.store.engine.begin() as c:
            await c.execute(
                update(BatchJobRow)
                .where(BatchJobRow.tenant_id == account, BatchJobRow.claimed_by == "elsewhere-0")
                .values(status=DONE, responses=b"{}")
            )
        r = await harness.http.post(url, headers=harness.auth(token), json=body)
        assert r.status_code == 200, r.text
        poll = {"request_id": r.json()["result"]["request_id"]}
        for _ in range(400):  # done before the rows go
            result = (
                await harness.http.post(url.split("?")[0], headers=harness.auth(token), json=poll)
            ).json()
            if "responses" in result["result"]:
                break
            await asyncio.sleep(0.05)
        assert result["result"]["responses"][0]["success"], result
    finally:
        services.settings = settings
        async with services.store.engine.begin() as c:
            await c.execute(delete(BatchJobRow).where(BatchJobRow.tenant_id == account))


async def test_the_pending_cap_counts_queued_and_running_jobs_only(store: Store) -> None:
    queue = BatchQueue(store.engine)
    tenant = uuid.uuid4().hex
    first = await queue.submit(tenant, "m", b"[]", 0, max_pending=2)
    second = await queue.submit(tenant, "m", b"[]", 0, max_pending=2)
    assert await queue.submit(tenant, "m", b"[]", 0, max_pending=2) == Refused("pending")
    assert isinstance(first, str) and isinstance(second, str)
    assert await queue.submit(uuid.uuid4().hex, "m", b"[]", 0, max_pending=2)  # another tenant's own cap
    async with store.engine.begin() as c:
        await c.execute(update(BatchJobRow).where(BatchJobRow.id == first).values(status=DONE))
    assert await queue.submit(tenant, "m", b"[]", 0, max_pending=2)
    async with store.engine.begin() as c:
        await c.execute(delete(BatchJobRow).where(BatchJobRow.tenant_id == tenant))


async def test_a_store_error_while_renewing_leaves_no_work_running_unowned(harness: Harness) -> None:
    """The store fails the lease renewal (SQLite busy, a PostgreSQL failover): the job's requests stop
    with it (it once ran on without a lease, while its lease expired and another worker ran and
    billed the same requests again)."""
    from sqlalchemy.exc import OperationalError

    services = harness.services
    await services.batch.stop()
    settings = services.settings
    services.settings = dataclasses.replace(settings, batch_lease_s=0.6)
    other = BatchWorker()
    try:
        body = {"requests": [{"messages": [{"role": "user", "content": "slow"}]} for _ in range(2)]}
        r = await harness.http.post(
            harness.path(f"/ai/run/{GLM}?queueRequest=true"), headers=harness.auth(), json=body
        )
        assert r.status_code == 200, r.text
        await other.start(services)

        async def broken_renew(*args: object, **kwargs: object) -> bool:
            raise OperationalError("UPDATE", {}, Exception("database is locked"))

        other.queue.renew = broken_renew  # type: ignore[method-assign]
        for _ in range(50):
            await asyncio.sleep(0.1)
            if not other._jobs:
                break
        running = [t for t in asyncio.all_tasks() if "_execute" in repr(t.get_coro()) and not t.done()]
        for task in running:
            task.cancel()
        assert not other._jobs and not running
    finally:
        await other.stop()
        services.settings = settings
        await services.batch.start(services)


async def test_a_stop_that_comes_as_the_idle_worker_is_woken_stops_it(harness: Harness) -> None:
    """A gateway stops just as its idle batch worker is woken (a job ending, a submit): the worker
    stops. (Python 3.11's `wait_for` returned the wake-up and dropped the cancel: the worker polled
    on, and the stop, which waits for it, waited forever; one CI run hung so.)"""
    services = harness.services
    await services.batch.stop()
    try:
        for turns in range(6):  # the cancel lands that many event-loop turns after the wake-up
            worker = BatchWorker()
            await worker.start(services)
            await asyncio.sleep(0.3)  # the purge and the first claim done: idle, waiting to be woken
            worker.wake()
            for _ in range(turns):
                await asyncio.sleep(0)
            stopping = asyncio.create_task(worker.stop())
            done, _ = await asyncio.wait({stopping}, timeout=5)
            if not done:  # a second cancel ends the loop: the test fails rather than hangs
                assert worker._task is not None
                worker._task.cancel()
                await asyncio.gather(stopping, return_exceptions=True)
            assert done, f"the stop hung with its cancel {turns} turns after the wake-up"
    finally:
        await services.batch.start(services)


async def test_a_suspended_tenants_job_waits_for_its_resume(harness: Harness) -> None:
    """An operator suspends a tenant while its job runs: the job is handed back within a third of
    its lease, its answers kept and the claim not counted as an attempt (suspensions never fail a
    job), and it is not taken again while the tenant stays suspended (its poll is a 403); once the
    tenant is resumed, the job runs to the end."""
    services = harness.services
    tenant_id, token = await _tenant(services, "held", "paid")
    await services.batch.stop()
    settings = services.settings
    services.settings = dataclasses.replace(settings, batch_lease_s=0.6)
    other = BatchWorker()
    try:
        body = {
            "requests": [
                {"messages": [{"role": "user", "content": "slow"}], "external_reference": str(i)}
                for i in range(2)
            ]
        }
        r = await harness.http.post(
            harness.path(f"/ai/run/{GLM}?queueRequest=true", tenant_id),
            headers=harness.auth(token),
            json=body,
        )
        job_id = r.json()["result"]["request_id"]
        await other.start(services)
        assert (await job_once(harness, job_id, tenant_id, RUNNING)).attempts == 1
        await asyncio.sleep(0.3)  # its requests are under way (~1.8 s each)
        suspended = await services.store.update_tenant(tenant_id, TenantPatch(suspended=True), actor="test")
        assert suspended.suspended_at is not None
        # handed back within a third of its 0.6 s lease
        assert (await job_once(harness, job_id, tenant_id, QUEUED, timeout_s=2)).attempts == 0
        other.wake()
        await asyncio.sleep(1.0)  # polls and wake-ups: the job is not taken
        job = await services.batch.queue.get(job_id, tenant_id)
        assert job is not None and job.status == QUEUED and job.attempts == 0 and not other._jobs
        services.authenticator.forget(tenant_id=tenant_id)
        r = await harness.http.post(
            harness.path(f"/ai/run/{GLM}", tenant_id),
            headers=harness.auth(token),
            json={"request_id": job_id},
        )
        assert r.status_code == 403 and r.json()["errors"][0]["code"] == 9109, r.text
        assert "suspended" in r.json()["errors"][0]["message"]

        await services.store.update_tenant(tenant_id, TenantPatch(suspended=False), actor="test")
        services.authenticator.forget(tenant_id=tenant_id)
        other.wake()
        result = await wait_done(harness, GLM, job_id, account=tenant_id, token=token)
    finally:
        await other.stop()
        services.settings = settings
        await services.batch.start(services)
    assert [x["external_reference"] for x in result["responses"]] == ["0", "1"]
    assert all(x["success"] for x in result["responses"])
    job = await services.batch.queue.get(job_id, tenant_id)
    assert job is not None and job.attempts == 1


def test_only_failures_another_attempt_would_meet_again_are_kept_as_answered() -> None:
    from gateway.batch import is_final
    from gateway.errors import BadInput, Busy, KumoError, OverTokenLimit, RateLimited, Timeout, Unavailable

    assert is_final(BadInput("bad input")) and is_final(OverTokenLimit("never fits"))
    assert not is_final(Timeout("too slow")) and not is_final(RateLimited("later", retry_after=1))
    assert not is_final(Busy("full")) and not is_final(Unavailable("no capacity", retry_after=5))
    assert not is_final(KumoError("internal"))


async def test_the_stored_bytes_cap_counts_a_tenants_kept_requests_and_results(store: Store) -> None:
    """Requests and results of every job not yet purged, queued to done, count against the tenant's
    `max_stored_bytes`; another tenant has its own."""
    queue = BatchQueue(store.engine)
    tenant, other = uuid.uuid4().hex, uuid.uuid4().hex
    first = await queue.submit(tenant, "m", b"x" * 400, 1, max_stored_bytes=1000)
    assert isinstance(first, str)
    async with store.engine.begin() as c:  # done, its result kept until purged
        await c.execute(
            update(BatchJobRow).where(BatchJobRow.id == first).values(status=DONE, responses=b"y" * 500)
        )
    expires = dt.datetime(2030, 1, 1, tzinfo=dt.UTC)
    async with store.engine.begin() as c:
        await c.execute(update(BatchJobRow).where(BatchJobRow.id == first).values(expires_at=expires))
    assert await queue.submit(tenant, "m", b"z" * 101, 1, max_stored_bytes=1000) == Refused(
        "stored", 900, expires
    )
    assert isinstance(await queue.submit(tenant, "m", b"z" * 100, 1, max_stored_bytes=1000), str)
    assert isinstance(await queue.submit(other, "m", b"z" * 1000, 1, max_stored_bytes=1000), str)
    async with store.engine.begin() as c:
        await c.execute(delete(BatchJobRow).where(BatchJobRow.tenant_id.in_((tenant, other))))


async def test_a_submit_is_a_request_refused_once_the_days_neurons_are_spent(harness: Harness) -> None:
    """A security review (2026-12-07): a tenant with no neurons left queued jobs whose every item
    was refused at admission, each refusal kept 24 h with its 1 KB reference, 3.4 MB/s of store. A
    submit now counts as a request, is refused (3036) with the day's neurons spent, and a tenant's
    kept jobs are capped in bytes."""
    services = harness.services
    account, token = await _tenant(services, "batch-spent", "paid")
    url = harness.path(f"/ai/run/{LEGACY}?queueRequest=true", account)
    body = {"requests": [{"prompt": "x", "external_reference": "A" * 1024}] * 50}
    await services.store.set_quotas(account, Quotas(daily_neurons=0), actor="test")
    services.authenticator.forget(tenant_id=account)
    r = await harness.http.post(url, headers=harness.auth(token), json=body)
    assert r.status_code == 429 and r.json()["errors"][0]["code"] == 3036, r.text
    await services.store.set_quotas(account, Quotas(daily_neurons=None), actor="test")
    services.authenticator.forget(tenant_id=account)
    settings = services.settings
    services.settings = dataclasses.replace(settings, batch_max_stored_bytes_per_tenant=60_000)
    try:
        r = await harness.http.post(url, headers=harness.auth(token), json=body)  # ~53 KB of requests
        assert r.status_code == 200, r.text
        r = await harness.http.post(url, headers=harness.auth(token), json=body)
        assert r.status_code == 429 and "would pass 60000" in r.json()["errors"][0]["message"], r.text
        # room comes back when the first kept job's results expire (a day after it finishes), not sooner
        assert int(r.headers["retry-after"]) >= settings.batch_result_ttl_s * 0.9
    finally:
        services.settings = settings
        async with services.store.engine.begin() as c:
            await c.execute(delete(BatchJobRow).where(BatchJobRow.tenant_id == account))

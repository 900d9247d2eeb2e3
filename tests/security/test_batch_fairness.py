"""Row 5 of issue 27: each gateway ran one batch job at a time, oldest first, and a job whose
requests hit 429 held the queue while it waited them out; another tenant's one-request job stayed
queued for minutes. Jobs now run side by side (one per tenant), their requests share the slots
round-robin by tenant, and a request waiting out a 429 holds no slot."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from gateway_harness import GLM, LEGACY, Harness, _tenant
from sqlalchemy import delete

from gateway.store.batch import DONE
from gateway.store.tables import BatchJobRow
from schemas.admin import Quotas

NUM_NOISY = 10  # slow requests (~1.8 s each on the fake backend) of the big job
SLOTS = 2


async def _submit(harness: Harness, account: str, token: str, model: str, requests: list[dict]) -> str:  # type: ignore[type-arg]
    r = await harness.http.post(
        harness.path(f"/ai/run/{model}?queueRequest=true", account),
        headers=harness.auth(token),
        json={"requests": requests},
    )
    assert r.status_code == 200, r.text
    return str(r.json()["result"]["request_id"])


async def test_a_small_job_is_not_held_behind_a_big_or_a_rate_limited_one(harness: Harness) -> None:
    services = harness.services
    noisy, noisy_token = await _tenant(services, "batch-noisy", "paid")
    limited, limited_token = await _tenant(services, "batch-limited", "paid")
    await services.store.set_quotas(limited, Quotas(requests_per_minute=1), actor="test")
    small, small_token = await _tenant(services, "batch-small", "paid")
    slow = {"messages": [{"role": "user", "content": "slow"}]}
    await services.batch.stop()
    settings = services.settings
    services.settings = dataclasses.replace(settings, batch_concurrency=SLOTS)
    try:
        # the oldest job: its 2nd and 3rd requests get 429 and wait for the next minute
        limited_job = await _submit(harness, limited, limited_token, LEGACY, [{"prompt": "x"}] * 3)
        noisy_job = await _submit(harness, noisy, noisy_token, GLM, [slow] * NUM_NOISY)
        await services.batch.start(services)
        await asyncio.sleep(0.5)
        start = time.monotonic()
        small_job = await _submit(harness, small, small_token, GLM, [slow])
        while True:
            assert time.monotonic() - start < 30, "the small job never finished"
            job = await services.batch.queue.get(small_job, small)
            assert job is not None
            if job.status == DONE:
                break
            await asyncio.sleep(0.05)
        waited = time.monotonic() - start
        states = {
            name: (await services.batch.queue.get(job_id, tenant)).status  # type: ignore[union-attr]
            for name, job_id, tenant in (("noisy", noisy_job, noisy), ("limited", limited_job, limited))
        }
        print(
            f"tried a 1-request job behind a {NUM_NOISY}-request slow job and a 3-request job at 1 "
            f"request/min ({SLOTS} slots): done in {waited:.1f} s; the others then: {states}"
        )
        assert states["noisy"] != DONE  # it did not have to wait for the big job to end
        assert waited < 3 * 1.8 + 2.0  # one noisy request ahead of it, then its own, plus slack
    finally:
        await services.batch.stop()
        services.settings = settings
        async with services.store.engine.begin() as c:
            await c.execute(delete(BatchJobRow).where(BatchJobRow.tenant_id.in_([noisy, limited, small])))
        await services.batch.start(services)


async def test_slots_go_round_robin_by_tenant_and_survive_cancellation() -> None:
    """The scheduler alone: one slot, tenant a queues five requests, then b one and c one; b and c
    each wait behind at most one request of every other tenant. A cancelled waiter gives its turn up."""
    from gateway.fair_slots import FairSlots

    slots = FairSlots(1)
    order: list[str] = []
    release = asyncio.Event()

    async def request(tenant: str, n: int) -> None:
        async with slots.slot(tenant):
            order.append(f"{tenant}{n}")
            await release.wait()
            release.clear()

    tasks = [asyncio.create_task(request("a", n)) for n in range(5)]
    await asyncio.sleep(0)
    tasks += [asyncio.create_task(request("b", 0)), asyncio.create_task(request("c", 0))]
    doomed = asyncio.create_task(request("d", 0))
    await asyncio.sleep(0)
    doomed.cancel()
    for _ in range(100):  # bounded: each round lets the holder finish and the next one start
        if len(order) == 7:
            break
        await asyncio.sleep(0)
        release.set()
        await asyncio.sleep(0)
    release.set()
    await asyncio.wait_for(asyncio.gather(*tasks), 5)
    print(f"tried 5 requests of a, then 1 of b, c and a cancelled d, through 1 slot: served {order}")
    assert order == ["a0", "a1", "b0", "c0", "a2", "a3", "a4"]
    assert slots.num_busy == 0

# ruff: noqa: F811  (pytest fixtures imported by name)
"""Stream lifecycle: a client that goes away aborts the backend request and is still metered; a
client that trickles its body times out; every request lands in the usage ledger."""

from __future__ import annotations

import asyncio
import datetime as dt

from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)


async def usage_by_model(h: Harness, account: str) -> dict[str, tuple[int, int]]:
    await h.services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    rows = await h.services.store.usage(account, since=today, until=today, group_by="model")
    return {r.model or "": (r.requests, r.completion_tokens) for r in rows}


async def test_a_client_disconnect_closes_the_backend_stream(harness: Harness) -> None:
    backend = harness.backends["glm-5.2"][0]
    before = await usage_by_model(harness, harness.account)
    async with harness.http.stream(
        "POST",
        harness.path(f"/ai/run/{GLM}"),
        headers=harness.auth(),
        json={"prompt": "slow", "stream": True},
    ) as r:
        async for line in r.aiter_lines():
            if '"content":"ech' in line:
                break
        assert backend.num_open_streams == 1
    for _ in range(50):
        if backend.num_open_streams == 0:
            break
        await asyncio.sleep(0.05)
    assert backend.num_open_streams == 0
    after = await usage_by_model(harness, harness.account)
    assert after[GLM][0] == before.get(GLM, (0, 0))[0] + 1  # the abandoned request is still recorded


async def test_a_cut_stream_is_billed_the_prompt_the_backend_counted(harness: Harness) -> None:
    """A stream the client leaves before the backend's usage came is billed the prompt as the backend
    counted it in its first event (7 + len("slow") tokens on the fake backend), and a token per delta
    delivered: not the gateway's estimate from the body's bytes plus the template's allowance."""
    await harness.services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    before = await harness.services.store.usage(harness.account, since=today, until=today, group_by="model")
    old = next((r for r in before if r.model == GLM), None)
    async with harness.http.stream(
        "POST",
        harness.path(f"/ai/run/{GLM}"),
        headers=harness.auth(),
        json={"prompt": "slow", "stream": True, "max_tokens": 64},
    ) as r:
        async for line in r.aiter_lines():
            if '"content":"ech' in line:
                break
    for _ in range(50):
        await harness.services.ledger.flush()
        rows = await harness.services.store.usage(harness.account, since=today, until=today, group_by="model")
        new = next((r for r in rows if r.model == GLM), None)
        if new is not None and new.requests > (old.requests if old else 0):
            break
        await asyncio.sleep(0.05)
    assert new is not None and new.requests == (old.requests if old else 0) + 1
    assert new.prompt_tokens - (old.prompt_tokens if old else 0) == 7 + len("slow")
    assert 1 <= new.completion_tokens - (old.completion_tokens if old else 0) <= 3


async def test_a_slow_body_times_out(harness: Harness) -> None:
    async def trickle():  # type: ignore[no-untyped-def]
        yield b'{"prompt": '
        await asyncio.sleep(1.5)
        yield b'"x"}'

    r = await harness.http.post(harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), content=trickle())
    assert r.status_code == 408 and r.json()["errors"][0]["code"] == 3046


async def test_usage_is_recorded_per_request(harness: Harness) -> None:
    before = await usage_by_model(harness, harness.account)
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": "count me", "n": 2}
    )
    completion = r.json()["result"]["usage"]["completion_tokens"]
    after = await usage_by_model(harness, harness.account)
    old_requests, old_tokens = before.get(KIMI, (0, 0))
    assert after[KIMI] == (old_requests + 1, old_tokens + completion)


async def test_many_streams_with_disconnects_leave_nothing_behind(harness: Harness) -> None:
    """40 concurrent slow streams, every other one abandoned after its first frame: afterwards no
    backend stream, router slot or in-flight request is left (reliability §2.4)."""
    backend = harness.backends["glm-5.2"][0]

    async def one(i: int) -> str | None:
        async with harness.http.stream(
            "POST",
            harness.path(f"/ai/run/{GLM}"),
            headers=harness.auth(),
            json={"prompt": "slow", "stream": True},
        ) as r:
            text = ""
            async for line in r.aiter_lines():
                text += line
                if i % 2 and '"content":"ech' in line:
                    return None
            return text

    results = await asyncio.gather(*(one(i) for i in range(40)))
    finished = [t for t in results if t is not None]
    assert len(finished) == 20 and all("[DONE]" in t and '"usage"' in t for t in finished)
    for _ in range(60):
        replicas = harness.services.router.pools["glm-5.2"].replicas
        if backend.num_open_streams == 0 and all(r.num_in_flight == 0 for r in replicas):
            break
        await asyncio.sleep(0.05)
    assert backend.num_open_streams == 0
    assert all(r.num_in_flight == 0 for r in harness.services.router.pools["glm-5.2"].replicas)
    assert harness.services.metrics.registry.get_sample_value("kumo_gateway_requests_in_flight") == 0


async def test_a_choice_failing_beside_a_running_one_ends_both_and_is_billed_once(harness: Harness) -> None:
    """n = 2 without streaming: the first choice's backend crashes mid-answer while the second is
    still generating. The caller gets the API's error (not a RuntimeError from closing a stream still
    being read), the second choice's backend request is closed at once, and the call is settled and
    recorded exactly once (it once skipped the settlement: the worst case stayed reserved all day)."""
    backends = harness.backends["kimi-k2.6"]  # both choices go to one of them (the call's affinity)
    before = await usage_by_model(harness, harness.account)
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": "crash-one", "n": 2}
    )
    assert r.status_code == 500 and r.json()["errors"][0]["code"] == 3000
    assert r.json()["success"] is False
    assert sorted(b.num_crash_one for b in backends)[-1] == 2
    for _ in range(20):
        if all(b.num_open_streams == 0 for b in backends):
            break
        await asyncio.sleep(0.05)
    assert all(b.num_open_streams == 0 for b in backends)  # the slow choice did not run on (~2 s)
    after = await usage_by_model(harness, harness.account)
    assert after[KIMI][0] == before.get(KIMI, (0, 0))[0] + 1
    replicas = harness.services.router.pools["kimi-k2.6"].replicas
    assert all(rep.num_in_flight == 0 for rep in replicas)


async def test_a_client_that_leaves_a_non_streaming_request_stops_it(harness: Harness) -> None:
    """A non-streaming answer sends nothing before it is whole, so only the disconnect itself tells
    that its client gave up (a first-hour probe's `curl -m 4` left 1,500 tokens generating for 45 s,
    billed; the OpenAI SDK retries a timeout twice): the backend stream closes at once, and the
    request is still recorded."""
    import httpx

    backend = harness.backends["glm-5.2"][0]
    before = await usage_by_model(harness, harness.account)
    body = {"prompt": "slow"}  # ~0.3 s an event, seconds in all
    with_timeout = httpx.AsyncClient(base_url=str(harness.http.base_url), timeout=0.6)
    async with with_timeout:
        try:
            await with_timeout.post(harness.path(f"/ai/run/{GLM}"), headers=harness.auth(), json=body)
            raise AssertionError("the slow answer came within 0.6 s")
        except httpx.ReadTimeout:
            left = asyncio.get_running_loop().time()
    while backend.num_open_streams and asyncio.get_running_loop().time() - left < 5:
        await asyncio.sleep(0.02)
    assert backend.num_open_streams == 0
    assert asyncio.get_running_loop().time() - left < 0.5  # closed when the client left, not at the end
    after = await usage_by_model(harness, harness.account)
    assert after[GLM][0] == before.get(GLM, (0, 0))[0] + 1

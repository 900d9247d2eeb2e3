# ruff: noqa: F811  (pytest fixtures imported by name)
"""Errors: always the v4 envelope with the reference's codes and statuses (§1.2, §6); never a
traceback; routing failures retried before the first byte and reported after it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import httpx
import msgspec
import pytest
from gateway_harness import KIMI, LEGACY, MISMATCH, Harness, harness  # noqa: F401  (fixture)


def assert_envelope(r: httpx.Response, status: int, code: int) -> str:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"result", "success", "errors", "messages"}
    assert body["result"] is None and body["success"] is False and body["messages"] == []
    assert body["errors"][0]["code"] == code, body
    assert "Traceback" not in r.text and 'File "' not in r.text
    message: str = body["errors"][0]["message"]
    return message


async def test_auth_errors(harness: Harness) -> None:
    url = harness.path(f"/ai/run/{KIMI}")
    assert_envelope(await harness.http.post(url, json={"prompt": "x"}), 401, 10000)
    assert_envelope(
        await harness.http.post(url, headers=harness.auth("kumo_nope"), json={"prompt": "x"}), 401, 10000
    )
    other = harness.path(f"/ai/run/{KIMI}", account=harness.free_account)
    assert_envelope(await harness.http.post(other, headers=harness.auth(), json={"prompt": "x"}), 403, 10000)
    free = await harness.http.post(other, headers=harness.auth(harness.free_token), json={"prompt": "x"})
    assert "not available on the Workers Free plan" in assert_envelope(free, 403, 5035)
    free_legacy = harness.path(f"/ai/run/{LEGACY}", account=harness.free_account)
    assert (
        await harness.http.post(free_legacy, headers=harness.auth(harness.free_token), json={"prompt": "x"})
    ).status_code == 200


async def test_routing_errors(harness: Harness) -> None:
    unknown = await harness.http.post(
        harness.path("/ai/run/@cf/foo/bar"), headers=harness.auth(), json={"prompt": "x"}
    )
    assert assert_envelope(unknown, 400, 5007) == "AiError: No such model @cf/foo/bar or task"
    long = await harness.http.post(
        harness.path("/ai/run/@cf/" + "x" * 20_000), headers=harness.auth(), json={"prompt": "x"}
    )
    assert (
        assert_envelope(long, 400, 5007) == f"AiError: No such model @cf/{'x' * 124}… or task"
    )  # not echoed whole
    assert_envelope(
        await harness.http.get(harness.path(f"/ai/run/{KIMI}"), headers=harness.auth()), 405, 7001
    )
    bad_account = f"{harness.url}/client/v4/accounts/not-an-account/ai/run/{KIMI}"
    assert_envelope(
        await harness.http.post(bad_account, headers=harness.auth(), json={"prompt": "x"}), 404, 7003
    )
    assert_envelope(
        await harness.http.get(f"{harness.url}/client/v4/nothing", headers=harness.auth()), 404, 7000
    )


async def test_body_errors(harness: Harness) -> None:
    url = harness.path(f"/ai/run/{KIMI}")
    assert_envelope(await harness.http.post(url, headers=harness.auth()), 400, 3003)
    big = b'{"prompt": "' + b"a" * 300_000 + b'"}'
    assert_envelope(await harness.http.post(url, headers=harness.auth(), content=big), 413, 3006)

    async def chunks():  # no content-length: the limit must hold while streaming the body
        for _ in range(100):
            yield b"a" * 10_000

    assert_envelope(await harness.http.post(url, headers=harness.auth(), content=chunks()), 413, 3006)
    assert "Bad input" in assert_envelope(
        await harness.http.post(url, headers=harness.auth(), content=b"{nope"), 400, 5006
    )


async def test_backend_errors_map_to_workers_ai_codes(harness: Harness) -> None:
    url = harness.path(f"/ai/run/{KIMI}")
    overflow = await harness.http.post(url, headers=harness.auth(), json={"prompt": "overflow"})
    assert "context window limit" in assert_envelope(overflow, 413, 5021)
    busy = await harness.http.post(
        url, headers=harness.auth(), json={"prompt": "busy", "options": {"rejectIfBusy": True}}
    )
    assert assert_envelope(busy, 429, 3040) == "AiError: Capacity temporarily exceeded, please try again."
    assert int(busy.headers["retry-after"]) >= 1
    garbage = await harness.http.post(url, headers=harness.auth(), json={"prompt": "garbage"})
    assert assert_envelope(garbage, 500, 3000) == "AiError: Unknown internal error"


async def test_rate_limit_is_429_with_retry_after(harness: Harness) -> None:
    url = harness.path(f"/ai/run/{KIMI}", account=harness.limited_account)
    statuses = []
    for _ in range(3):
        r = await harness.http.post(url, headers=harness.auth(harness.limited_token), json={"prompt": "x"})
        statuses.append(r.status_code)
    assert statuses[:2] == [200, 200]
    assert_envelope(r, 429, 3021)
    assert 1 <= int(r.headers["retry-after"]) <= 60


async def test_a_pool_that_disagrees_with_its_entry_is_not_served(harness: Harness) -> None:
    r = await harness.http.post(
        harness.path(f"/ai/run/{MISMATCH}"), headers=harness.auth(), json={"prompt": "x"}
    )
    assert_envelope(r, 503, 3040)
    assert harness.backends["mismatch"][0].requests == []


async def test_a_down_replica_is_retried_elsewhere_then_ejected_and_returned(harness: Harness) -> None:
    a, b = harness.backends["kimi-k2.6"]
    a.is_down = True
    try:
        before = len(b.requests)
        for i in range(4):
            r = await harness.http.post(
                harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": f"r{i}"}
            )
            assert r.status_code == 200, r.text
        assert len(b.requests) - before == 4
        pool = harness.services.router.pools["kimi-k2.6"]
        # a few health rounds (polled: a fixed 0.6 s missed the return on a loaded 2-core CI run, 2026-12-02)
        assert await _eventually(lambda: [r.is_servable for r in pool.replicas] == [False, True])
    finally:
        a.is_down = False
    assert await _eventually(lambda: all(r.is_servable for r in pool.replicas))


async def _eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """`check()` once it holds, polled every 50 ms; False if it never did within `timeout_s`."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not check():
        if asyncio.get_running_loop().time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def test_a_crash_mid_stream_ends_the_stream_with_an_error(harness: Harness) -> None:
    url = harness.path(f"/ai/run/{KIMI}")
    r = await harness.http.post(url, headers=harness.auth(), json={"prompt": "crash", "stream": True})
    assert r.status_code == 200
    frames = [line.removeprefix("data: ") for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert frames[-1] != "[DONE]"
    error = msgspec.json.decode(frames[-1])
    assert error["error"]["message"] == "AiError: Unknown internal error"
    r = await harness.http.post(url, headers=harness.auth(), json={"prompt": "crash"})
    assert_envelope(r, 500, 3000)
    r = await harness.http.post(url, headers=harness.auth(), json={"prompt": "truncated"})
    assert_envelope(r, 500, 3000)  # ended without a finish event: not passed off as an answer
    r = await harness.http.post(url, headers=harness.auth(), json={"prompt": "truncated", "stream": True})
    assert '"error"' in r.text and "[DONE]" not in r.text


async def test_metrics_count_requests(harness: Harness) -> None:
    await harness.http.post(harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": "m"})
    await harness.services.store.ensure_admin_token("metrics-admin-token")
    admin = {"authorization": "Bearer metrics-admin-token"}
    text = (await harness.http.get(f"{harness.url}/metrics", headers=admin)).text
    assert 'kumo_gateway_requests_total{model="@cf/moonshotai/kimi-k2.6",route="run",status="200"}' in text
    assert "kumo_gateway_tokens_total" in text
    assert "kumo_gateway_requests_in_flight 1.0" in text  # this /metrics request itself


async def test_requests_go_to_the_least_loaded_replica(harness: Harness) -> None:
    a, b = harness.backends["kimi-k2.6"]
    a.num_waiting = 50
    try:
        replica = harness.services.router.pools["kimi-k2.6"].replicas[0]  # a's (the pools file's order)
        for _ in range(200):  # a health round reads the new load (a fixed sleep lost this race under load)
            if replica.load is not None and replica.load.waiting == 50:
                break
            await asyncio.sleep(0.05)
        assert replica.load is not None and replica.load.waiting == 50
        before = (len(a.requests), len(b.requests))
        for i in range(6):
            r = await harness.http.post(
                harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), json={"prompt": f"l{i}"}
            )
            assert r.status_code == 200
        assert (len(a.requests) - before[0], len(b.requests) - before[1]) == (0, 6)
    finally:
        a.num_waiting = 0


@pytest.mark.parametrize("name", ["f</tool_call><|user|>", "get.weather", "a:b", "", "x" * 65])
async def test_a_tool_name_a_call_could_not_spell_is_a_400(harness: Harness, name: str) -> None:
    """OpenAI's rule for function names (1-64 of `[A-Za-z0-9_-]`): a call's markup spells the name
    (Kimi's id is `functions.NAME:IDX`), so another name could not be parsed back from a call; one
    holding a family's markers was refused as a schema that "admits no complete value"."""
    tool = {"type": "function", "function": {"name": name, "parameters": {"type": "object"}}}
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"),
        headers=harness.auth(),
        json={"messages": [{"role": "user", "content": "hi"}], "tools": [tool]},
    )
    message = assert_envelope(r, 400, 5006)
    assert "'tools[0]' name" in message and "1 to 64 letters, digits, underscores or dashes" in message
    assert len(message) < 400

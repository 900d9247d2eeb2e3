"""Row 11 of issue 27: polling an async batch job read the database on every call without passing
the rate limiter. A poll now counts as one request against the tenant's requests per minute."""

from __future__ import annotations

from gateway_harness import LEGACY, Harness, _tenant

from schemas.admin import Quotas

NUM_POLLS = 12  # bounded: a burst well past the limit


async def _queued_job(harness: Harness, name: str, quotas: Quotas) -> tuple[str, str, str]:
    """A new tenant with `quotas` and one queued job: (its run URL, its token, the job's id)."""
    account, token = await _tenant(harness.services, name, "paid")
    await harness.services.store.set_quotas(account, quotas, actor="test")
    url = harness.path(f"/ai/run/{LEGACY}", account)
    r = await harness.http.post(
        f"{url}?queueRequest=true", headers=harness.auth(token), json={"requests": [{"prompt": "p"}]}
    )
    assert r.status_code == 200, r.text
    return url, token, r.json()["result"]["request_id"]


async def test_polling_a_job_goes_through_the_rate_limiter(harness: Harness) -> None:
    url, token, job_id = await _queued_job(harness, "poll-burst", Quotas(requests_per_minute=4))
    statuses = []
    for _ in range(NUM_POLLS):
        r = await harness.http.post(url, headers=harness.auth(token), json={"request_id": job_id})
        statuses.append(r.status_code)
        if r.status_code == 429:
            body = r.json()
            assert body["success"] is False and body["errors"][0]["code"] == 3021, body
            assert int(r.headers["retry-after"]) >= 1
    print(f"tried {NUM_POLLS} polls at requests_per_minute=4: got {statuses}")
    # the job's own request counts too; a minute boundary inside the burst may reset the window
    # once: at most two windows' worth pass
    assert 1 <= statuses.count(200) <= 8, statuses
    assert statuses.count(429) >= NUM_POLLS - 8 and set(statuses) <= {200, 429}, statuses
    # another tenant is not slowed by it
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}"), headers=harness.auth(), json={"request_id": job_id}
    )
    print(f"tried the same job id from another tenant: got {r.status_code}")
    assert r.status_code == 404


async def test_a_spent_token_window_does_not_stop_a_poll(harness: Harness) -> None:
    """A poll carries no tokens: a tenant whose minute of tokens is spent by its other requests still
    collects its job's state and results (a probe, 2026-12-07: a 429 "tokens per min rate reached")."""
    url, token, job_id = await _queued_job(harness, "poll-tokens", Quotas(tokens_per_minute=60))
    statuses = []
    for _ in range(12):  # spend the minute's tokens: each answer outruns its estimate (the echo's)
        r = await harness.http.post(
            url, headers=harness.auth(token), json={"prompt": "a few more words", "max_tokens": 1}
        )
        statuses.append(r.status_code)
        if r.status_code == 429:
            break
    assert statuses[-1] == 429 and "tokens per min" in r.text, statuses
    r = await harness.http.post(url, headers=harness.auth(token), json={"request_id": job_id})
    assert r.status_code == 200, r.text

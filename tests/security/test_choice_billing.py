"""Security review, item 4: with `n` choices the prompt was billed once (choice 0's usage) though
each choice is its own backend request, and a text-only request spread its choices over replicas,
so no prefix cache could share the prompt between them. Every choice of one request now goes to
one replica, and each later choice adds the prompt tokens its replica's cache did not serve."""

from __future__ import annotations

import asyncio
import datetime as dt

from gateway_harness import GLM, KIMI, Harness, _tenant

from gateway.usage import neurons

PROMPT = "share this prompt"
PROMPT_TOKENS = 7 + len(PROMPT)  # the fake backend's count for it, of which 4 come from its cache
CACHED_TOKENS = 4


async def test_the_choices_of_a_text_request_go_to_one_replica(harness: Harness) -> None:
    kimi = harness.backends["kimi-k2.6"]
    for stream in (False, True, False, True):
        before = [len(b.requests) for b in kimi]
        r = await harness.http.post(
            harness.path(f"/ai/run/{KIMI}"),
            headers=harness.auth(),
            json={"messages": [{"role": "user", "content": PROMPT}], "n": 4, "stream": stream},
        )
        assert r.status_code == 200, r.text
        got = [len(b.requests) - n for b, n in zip(kimi, before, strict=True)]
        print(f"tried n=4 text-only (stream={stream}) over 2 replicas: choices per replica {got}")
        assert sorted(got) == [0, 4]


async def test_each_choice_pays_the_prompt_its_replica_did_not_cache(harness: Harness) -> None:
    account, token = await _tenant(harness.services, "four-choices", "paid")
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}", account),
        headers=harness.auth(token),
        json={"messages": [{"role": "user", "content": PROMPT}], "n": 4},
    )
    usage = r.json()["result"]["usage"]
    # choice 0's prompt whole; choices 1-3 only what the cache did not serve
    prompt_tokens = PROMPT_TOKENS + 3 * (PROMPT_TOKENS - CACHED_TOKENS)
    assert usage["prompt_tokens"] == prompt_tokens
    assert usage["prompt_tokens_details"]["cached_tokens"] == CACHED_TOKENS
    await harness.services.ledger.flush()
    today = dt.datetime.now(dt.UTC).date()
    [row] = await harness.services.store.usage(account, since=today, until=today, group_by="model")
    price = harness.services.catalog.get(KIMI).price
    print(
        f"n=4: billed {row.prompt_tokens} prompt tokens ({row.cached_tokens} cached), {row.neurons:.4f} neurons"
    )
    assert (row.prompt_tokens, row.cached_tokens) == (prompt_tokens, CACHED_TOKENS)
    assert row.neurons == neurons(price, prompt_tokens, CACHED_TOKENS, usage["completion_tokens"])


async def test_later_choices_start_once_the_first_has_its_prompt(harness: Harness) -> None:
    """Routed at once, every choice prefilled the whole prompt (none could hit the others' pages).
    The first choice now goes alone and the others follow its first event, by when its prompt's pages
    are in the replica's prefix cache: the "slow" script's first event comes after 0.3 s, and until
    then the replica has one request of the three."""
    glm = harness.backends["glm-5.2"][0]
    before = len(glm.requests)
    call = asyncio.create_task(
        harness.http.post(
            harness.path(f"/ai/run/{GLM}"),
            headers=harness.auth(),
            json={"messages": [{"role": "user", "content": "slow"}], "n": 3},
        )
    )
    await asyncio.sleep(0.15)
    assert len(glm.requests) - before <= 1
    r = await call
    assert r.status_code == 200, r.text
    assert len(r.json()["result"]["choices"]) == 3 and len(glm.requests) - before == 3


async def test_a_later_choice_that_times_out_closes_the_first(harness: Harness) -> None:
    """The first choice's stream is open while the others are routed; when one of them fails (here
    the call's deadline: 0.45 s, the "slow" script's first event after 0.3 s each), the answer is a
    408 and the first choice's backend stream is closed, not left generating."""
    glm = harness.backends["glm-5.2"][0]
    r = await harness.http.post(
        harness.path(f"/ai/run/{GLM}"),
        headers={"cf-aig-request-timeout": "450", **harness.auth()},
        json={"messages": [{"role": "user", "content": "slow"}], "n": 2},
    )
    assert r.status_code == 408, r.text
    for _ in range(40):
        if glm.num_open_streams == 0:
            break
        await asyncio.sleep(0.05)
    assert glm.num_open_streams == 0

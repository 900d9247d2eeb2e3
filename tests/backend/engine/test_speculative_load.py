"""Speculative decoding under changing load (issue 28, "no loss at c=64"): what a review of the catch-up
gate and the draft cap found, each as the engine or the policy now behaves.

- A sequence refused a catch-up is asked again on later steps (a refusal once lasted until it finished).
- A winning load's refresh step (one plain step) does not stop its sequences drafting.
- Steps where only some sequences drafted do not price a draft length for all of them.
- A queue the pool cannot admit from does not count towards the draft cap.
- Pending drafts keep their verify rows out of the prefill budget (at most half of it): a prefill
  backlog does not crowd every verify out, nor drafting decodes every prompt.
- Prompt chunks get their MTP KV as they are prefilled where drafting may run: no catch-up later, and
  a prompt longer than a step's budget does not leave a gap too long to catch up.
- A preempted sequence's drafts are forgotten with its KV.
"""

from __future__ import annotations

from typing import Any

import pytest

from backend.engine.speculative.policy import MIN_RATE_SAMPLES, SPEC_PROBE_STEPS, StepLoad
from tests.backend.engine.test_draft_policy import drive, policy, toy
from tests.backend.engine_helpers import Result, collect, request, run_all


def test_a_refresh_gap_does_not_stop_a_winning_load() -> None:
    """Drafting wins at 8 sequences but measured only 5% above plain steps, within the margin a
    winning load keeps drafting through; a refresh's plain step leaves each sequence one position
    behind. The measured saving would read nothing once the rates cross, so the cost model prices
    it: one position against thousands of tokens pays."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    drive(p, MIN_RATE_SAMPLES + SPEC_PROBE_STEPS + 5, plain_rate=100.0, spec_rate=105.0, num_seqs=8)
    rates = p._rates[8]
    assert rates.is_winning
    p.observe_catch_up(8, 0.5, gap_rows=800)
    rates.spec = 0.97 * rates.plain  # still winning: within RATE_MARGIN
    assert p.pays_to_catch_up(8, gap=1, tokens_left=4000)
    rates.spec = 1.5 * rates.plain  # measured faster: seconds decide
    assert p.pays_to_catch_up(8, gap=1, tokens_left=4000)
    assert not p.pays_to_catch_up(8, gap=700, tokens_left=1)


def test_steps_where_some_sequences_drafted_do_not_price_a_draft_length() -> None:
    """One of eight sequences drafting costs a step about what eight do: such steps count towards the
    load's drafting rate but not towards a k's measured cost or the overhead, which are priced for
    every sequence drafting."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    for _ in range(MIN_RATE_SAMPLES):
        p.observe_step(8, False, False, 8, 0.001)
    p.observe_step(8, True, True, 11, 0.002, 3, num_drafting=1)
    rates = p._rates[8]
    assert rates.num_spec == 1 and not rates.step_s_by_k and rates.num_overhead == 0
    p.observe_step(8, True, True, 24, 0.002, 3, num_drafting=8)
    assert set(rates.step_s_by_k) == {3} and rates.num_overhead == 1


def test_measured_costs_price_no_drafts_at_one_plain_step() -> None:
    """Measured costs are in plain steps of the load, so k = 0 costs one plain step even where the
    load's rows are past saturation (it was R / R_sat of them: drafting looked cheap beside it)."""
    p = policy(3, acceptance=0.9, saturation_rows=16)
    load = StepLoad(num_rows=64, num_drafting=64)
    rates = p.rates(load, p.acceptance, measured={1: 2.0, 2: 3.0, 3: 4.0})
    assert rates[0] == 64.0
    assert rates[1] == pytest.approx(64 * 1.9 / 2.0)
    assert max(range(4), key=lambda k: rates[k]) == 0  # 1.9 tokens for 2 plain steps does not pay


def test_a_short_catch_up_does_not_price_positions() -> None:
    """Below the saturation rows a forward costs the same whatever its rows: a catch-up of a few
    positions says nothing about what a position costs (it divided a step's fixed excess by them)."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    for _ in range(MIN_RATE_SAMPLES):
        p.observe_step(8, False, False, 8, 0.001)
    p.observe_catch_up(8, 0.004, gap_rows=8)
    assert p._rates[8].catch_up_s > 0 and p._rates[8].catch_up_row_s == 0
    p.observe_catch_up(8, 0.02, gap_rows=640)
    assert p._rates[8].catch_up_row_s > 0


def behind() -> tuple[Any, list[Any], dict[str, Result]]:
    """Four requests of 40-token prompts whose prompts and first 5 decodes ran as plain steps: every
    sequence behind (MTP KV to catch up before it drafts). The engine, the requests, their results."""
    engine = toy(3)
    assert engine.spec is not None
    reqs = [request(f"r{i}", [i % 16] * 40, max_tokens=60) for i in range(4)]
    for r in reqs:
        engine.add_request(r)
    results: dict[str, Result] = {}
    engine.spec.policy.forced_k = 0
    for _ in range(6):
        collect(results, engine.step())
    engine.spec.policy.forced_k = None
    return engine, reqs, results


def test_a_refused_sequence_is_asked_again() -> None:
    """Plain steps leave every sequence behind; the first steps that would draft refuse each
    sequence's catch-up (the policy's answer, scripted), later ones accept it: every sequence
    drafts again, and the outputs are plain decoding's."""
    engine, reqs, results = behind()
    spec = engine.spec
    assert spec is not None
    asked: dict[str, int] = {}  # steps that found each sequence behind
    ask = spec.policy.pays_to_catch_up
    drafted: set[str] = set()
    drafting = spec.drafting

    def spy(out: Any, num_requests: int) -> list[bool]:
        for s in out.scheduled:
            if spec.book.gap(s.seq):
                asked[s.seq.request_id] = asked.get(s.seq.request_id, 0) + 1
        flags = drafting(out, num_requests)
        drafted.update(s.seq.request_id for s, f in zip(out.scheduled, flags, strict=True) if f)
        return flags

    def refuse_twice(num_seqs: int, gap: int, tokens_left: int) -> bool:
        return sum(asked.values()) > 2 * len(reqs) and ask(num_seqs, gap, tokens_left)

    spec.policy.pays_to_catch_up = refuse_twice  # type: ignore[method-assign]
    spec.drafting = spy  # type: ignore[method-assign]
    while engine.has_unfinished:
        collect(results, engine.step())
    assert all(n >= 2 for n in asked.values()) and len(asked) == len(reqs)
    assert drafted == {r.request_id for r in reqs}
    plain = run_all(toy(0), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_a_refused_catch_up_stands_for_a_while_and_the_step_is_plain() -> None:
    """A burst's tail (H100, 2026-12-06): the policy chose k = 3 for 60 steps in which every
    sequence's catch-up was refused, each sequence asked on every step (~0.1 ms a step) and every
    step counted as drafting. A refusal now stands `CATCH_UP_REASK` steps at its load, and a step in
    which nothing drafts is a plain one (k = 0)."""
    from backend.engine.speculative.decoder import CATCH_UP_REASK

    engine, reqs, results = behind()
    spec = engine.spec
    assert spec is not None
    asks: dict[str, int] = {}
    pays = spec.policy.pays_to_catch_up

    def refuse(num_seqs: int, gap: int, tokens_left: int) -> bool:
        asks[str(len(asks))] = 1
        return False

    spec.policy.pays_to_catch_up = refuse  # type: ignore[method-assign]
    steps, ks = 0, []
    while engine.has_unfinished:
        collect(results, engine.step())
        steps += 1
        ks.append(spec.k)
    assert steps >= 50 and set(ks) == {0} and engine.stats.spec_verifies == 0
    assert 0 < len(asks) <= len(reqs) * (steps // CATCH_UP_REASK + 1)
    spec.policy.pays_to_catch_up = pays  # type: ignore[method-assign]
    plain = run_all(toy(0), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_a_queue_the_pool_cannot_admit_does_not_count_towards_the_draft_cap() -> None:
    """Two long requests fill the pool; more than the draft cap wait for pages. The waiting ones
    cannot run before a running one finishes, so the two draft meanwhile (counted, the queue kept
    drafting off for as long as it lasted); outputs are plain decoding's."""
    config = dict(num_pages=40, page_size=4)  # 160 tokens: two prompts of 60 (15 pages each), then 10 pages
    engine = toy(3, **config)
    spec = engine.spec
    assert spec is not None
    cap = spec.max_drafting_seqs
    reqs = [request(f"r{i}", [i % 16] * 60, max_tokens=20) for i in range(cap + 4)]
    for r in reqs:
        engine.add_request(r)
    drafted_while_queued = 0
    results: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(results, engine.step())
        if spec.k and len(engine.scheduler.waiting) + len(engine.scheduler.running) > cap:
            drafted_while_queued += 1
            assert len(engine.scheduler.running) <= 2
    assert drafted_while_queued >= 3
    plain = run_all(toy(0, **config), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_pending_drafts_keep_their_rows_out_of_the_prefill_budget() -> None:
    """One user drafts; long prompts arrive, more than a step's budget each. Every step of their
    prefill still verifies the user's drafts (the prefill budget shrank by their rows), where the
    chunks once filled the budget and the drafts were thrown away each step."""
    engine = toy(3, max_num_batched_tokens=32, max_num_seqs=16)
    spec = engine.spec
    assert spec is not None
    engine.add_request(request("user", [3], max_tokens=200))
    results: dict[str, Result] = {}
    while engine.stats.spec_verifies < 3:
        collect(results, engine.step())
    for i in range(3):
        engine.add_request(request(f"long{i}", [i % 16] * 120, max_tokens=4))
    verifies_in_prefill = []
    while any(s.is_prefilling for s in engine.scheduler.running) or engine.scheduler.waiting:
        before = engine.stats.spec_verifies
        collect(results, engine.step())
        verifies_in_prefill.append(engine.stats.spec_verifies - before)
    assert len(verifies_in_prefill) >= 10 and min(verifies_in_prefill[1:]) >= 1
    while engine.has_unfinished:
        collect(results, engine.step())
    reqs = [request("user", [3], max_tokens=200)] + [
        request(f"long{i}", [i % 16] * 120, max_tokens=4) for i in range(3)
    ]
    plain = run_all(toy(0, max_num_batched_tokens=32, max_num_seqs=16), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_prompt_chunks_get_their_mtp_kv_as_they_are_prefilled() -> None:
    """A prompt of 200 tokens in chunks of 32, alone: each chunk's step runs the MTP layer over it,
    so the first decode drafts with no gap to catch up (200 positions, more than half a step's
    budget: it was given up, and the drafts read zeros there)."""
    engine = toy(3, max_num_batched_tokens=32, max_num_seqs=16)
    spec = engine.spec
    assert spec is not None
    req = request("r", [5] * 200, max_tokens=30)
    engine.add_request(req)
    results: dict[str, Result] = {}
    (seq,) = engine.scheduler.waiting
    fills = 0
    while seq.is_prefilling or seq.num_computed_tokens == 0:
        collect(results, engine.step())
        fills += spec.fills_draft_kv
        assert seq.num_draft_kv_tokens == seq.num_computed_tokens
    assert fills >= 5 and spec.book.can_ever_draft(seq)
    gaps = []
    while engine.has_unfinished:
        collect(results, engine.step())
        gaps.append(spec.num_gap_rows)
    assert engine.stats.spec_verifies > 0 and not any(gaps)
    assert (
        results["r"].token_ids
        == run_all(toy(0, max_num_batched_tokens=32, max_num_seqs=16), [req])["r"].token_ids
    )


def test_a_preempted_sequence_forgets_its_drafts() -> None:
    """A pool too small for every request: sequences are preempted while they hold drafts; each
    preempted one's drafts are gone at once (they were for KV that is gone), and the outputs are
    plain decoding's."""
    config = dict(num_pages=24, page_size=4, max_num_batched_tokens=64)
    engine = toy(3, **config)
    spec = engine.spec
    assert spec is not None
    reqs = [request(f"r{i}", [i % 16] * 6, max_tokens=30) for i in range(5)]
    for r in reqs:
        engine.add_request(r)
    results: dict[str, Result] = {}
    seen_preempted = 0
    while engine.has_unfinished:
        collect(results, engine.step())
        for seq in engine.scheduler.waiting:
            if seq.num_preemptions:
                seen_preempted += 1
                assert seq.request_id not in spec.book.proposed
    assert seen_preempted and engine.stats.spec_verifies > 0
    plain = run_all(toy(0, **config), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_drafting_decodes_leave_prefill_half_the_budget() -> None:
    """Four users draft three tokens a step in a budget of 16 rows: their drafts would take every row
    but their own four. A new prompt still gets half of what the decodes leave, and its first token
    comes within a few steps (it waited for the users to finish: 74 steps)."""
    config = dict(max_num_batched_tokens=16, max_num_seqs=16, speculative_max_seqs=16)
    engine = toy(3, **config)
    assert engine.spec is not None
    users = [request(f"u{i}", [i + 1], max_tokens=300) for i in range(4)]
    for r in users:
        engine.add_request(r)
    results: dict[str, Result] = {}
    while engine.stats.spec_verifies < 8:
        collect(results, engine.step())
    late = request("late", [7] * 8, max_tokens=4)
    engine.add_request(late)
    steps = 0
    while "late" not in results or not results["late"].token_ids:
        collect(results, engine.step())
        steps += 1
    assert steps <= 3
    while engine.has_unfinished:
        collect(results, engine.step())
    plain = run_all(toy(0, **config), [*users, late])
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_a_prefix_hit_without_mtp_kv_still_drafts() -> None:
    """A long prompt computed by plain steps (forced) is cached without MTP KV; a request that hits it
    has a gap too long to catch up: it drafts over zeros there (fewer accepted, never a wrong token),
    as before the gap rule changed, and the outputs are plain decoding's."""
    engine = toy(3, max_num_batched_tokens=64)
    spec = engine.spec
    assert spec is not None
    prefix = [3, 1, 4, 1, 5, 9, 2, 6] * 12  # 96 tokens, over half a step's budget
    spec.policy.forced_k = 0
    results: dict[str, Result] = {}
    writer = request("writer", prefix + [2], max_tokens=4)
    engine.add_request(writer)
    while engine.has_unfinished:
        collect(results, engine.step())
    spec.policy.forced_k = None
    hitter = request("hitter", prefix + [7], max_tokens=40)
    engine.add_request(hitter)
    seq = engine._seqs["hitter"]
    while engine.has_unfinished:
        collect(results, engine.step())
    assert seq.num_cached_tokens == 96 and spec.book.has_hole(seq)
    assert engine.stats.spec_verifies > 0
    plain = run_all(toy(0, max_num_batched_tokens=64), [writer, hitter])
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_requests_leave_no_policy_state_behind_however_they_end() -> None:
    """The policy keeps per-request state (its own verifies, explorations): every way a request
    ends — finished, aborted mid-decode, every request failed at once — takes it away."""
    engine = toy(3)
    policy_ = engine.spec.policy if engine.spec is not None else None
    assert policy_ is not None
    for i in range(3):
        engine.add_request(request(f"r{i}", [i + 1] * 5, max_tokens=30))
    results: dict[str, Result] = {}
    for _ in range(6):
        collect(results, engine.step())
    assert policy_._own  # drafting: their own verifies
    engine.abort("r1")
    while engine.has_unfinished:
        collect(results, engine.step())
    assert results["r1"].error is not None and results["r0"].error is None
    for i in range(3, 5):
        engine.add_request(request(f"r{i}", [i + 1] * 5, max_tokens=30))
    for _ in range(6):
        collect(results, engine.step())
    assert policy_._own
    from backend.errors import Aborted

    engine.fail_all(Aborted("the step failed"))
    assert not engine.has_unfinished
    assert (policy_._own, policy_._seen, policy_._exploring, policy_._explored) == ({}, set(), {}, {})

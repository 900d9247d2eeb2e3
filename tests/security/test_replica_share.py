"""Issue 27, the per-tenant share of a replica: one tenant could fill a replica's whole page pool
and every sequence slot, and another tenant's request waited until the first tenant's requests
ended. While another tenant waits, no tenant now holds more than `tenant_share` (default half) of
the pages or of `max_num_seqs`: its requests past the share wait, and its newest sequences are
preempted (recomputed later, to the same tokens) when the other tenant cannot start."""

from __future__ import annotations

from collections import Counter

from backend.engine.engine import Engine
from tests.backend.engine_helpers import TENANT_A, TENANT_B, Result, collect, make_engine, prompt_of, request

NUM_PAGES, MAX_SEQS = 16, 8
MAX_TOKENS = 30  # 20 prompt + 30 output tokens: 2 pages at admission, 4 at the end


def _holdings(engine: Engine) -> tuple[Counter[str], Counter[str]]:
    pages: Counter[str] = Counter()
    seqs: Counter[str] = Counter()
    for seq in engine.scheduler.running:
        pages[seq.request.tenant_salt] += seq.page_table.length
        seqs[seq.request.tenant_salt] += 1
    return pages, seqs


def _attack(share: float) -> tuple[int | None, list[tuple[int, int]], dict[str, Result]]:
    """Tenant A fills the replica with 8 requests; tenant B then asks for 2. Returns the step B first
    runs at, A's (pages, sequences) at each step while B waited, and everyone's results."""
    engine = make_engine(
        num_pages=NUM_PAGES, max_num_seqs=MAX_SEQS, max_num_batched_tokens=256, tenant_share=share
    )
    for i in range(8):
        engine.add_request(request(f"a{i}", prompt_of(i, 20), tenant=TENANT_A, max_tokens=MAX_TOKENS))
    results: dict[str, Result] = {}
    collect(results, engine.step())
    assert _holdings(engine) == (Counter({TENANT_A: NUM_PAGES}), Counter({TENANT_A: MAX_SEQS}))
    for i in range(2):
        engine.add_request(request(f"b{i}", prompt_of(100 + i, 20), tenant=TENANT_B, max_tokens=MAX_TOKENS))
    b_started, a_held = None, []
    for step in range(1, 400):  # bounded
        if not engine.has_unfinished:
            break
        collect(results, engine.step())
        pages, seqs = _holdings(engine)
        if b_started is None and seqs[TENANT_B]:
            b_started = step
        if b_started is None or any(s.request.tenant_salt == TENANT_B for s in engine.scheduler.waiting):
            a_held.append((pages[TENANT_A], seqs[TENANT_A]))
    return b_started, a_held, results


def test_one_tenant_cannot_hold_more_than_half_a_replica_while_another_waits() -> None:
    unfair_start, _, _ = _attack(1.0)
    b_started, a_held, results = _attack(0.5)
    print(
        f"tried 8 requests of tenant A filling {NUM_PAGES} pages / {MAX_SEQS} slots, then 2 of tenant B: "
        f"B first ran at step {b_started} (no share: step {unfair_start}); A held (pages, seqs) "
        f"while B waited: {a_held[:6]}"
    )
    assert unfair_start is not None and unfair_start > MAX_TOKENS // 2  # the attack worked before
    assert b_started is not None and b_started <= 3
    # from the first step after B arrived, A stays within half while B waits
    assert a_held and all(p <= NUM_PAGES // 2 and s <= MAX_SEQS // 2 for p, s in a_held), a_held
    # every request still ends, with the tokens it gets alone (preemption recomputes exactly)
    solo = make_engine(num_pages=64, max_num_seqs=16)
    alone: dict[str, Result] = {}
    for rid, seed in [(f"a{i}", i) for i in range(8)] + [(f"b{i}", 100 + i) for i in range(2)]:
        solo.add_request(request(rid, prompt_of(seed, 20), max_tokens=MAX_TOKENS))
    while solo.has_unfinished:
        collect(alone, solo.step())
    assert {r: x.token_ids for r, x in results.items()} == {r: x.token_ids for r, x in alone.items()}
    assert all(x.finish_reason == "length" for x in results.values())

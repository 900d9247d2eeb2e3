"""Fault injection: bugs done to the real allocator and page tables are caught by the tag checks.

For every scenario and model (the engine test model and the tiny real checkpoints of each family):
every injection is matched 1:1 with a detection (the injection log against the integrity-abort log
lines), exactly the victim is aborted and never emits a token computed from a wrong page, every
other request's output equals the clean run's, and the pool's free page count returns to its
starting value. The clean runs themselves must show 0 aborts over every step they check.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

from backend.engine.engine import Engine
from tests.backend.engine_faults import FaultInjector, Inject
from tests.backend.engine_helpers import (
    MODELS,
    TENANT_A,
    TENANT_B,
    ModelShelf,
    Result,
    collect,
    make_engine,
    prompt_of,
    request,
)

NUM_PAGES = 48
DETECTION = re.compile(r"request=(\S+) page=(\d+) expected=(-?\d+) found=(-?\d+) tenant=([0-9a-f]{12})$")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelShelf:
    return ModelShelf(Path(tmp_path_factory.mktemp("fault_models")))


def workload(vocab: int) -> list:
    """Eight requests, two tenants, prompts across page edges; one long prompt (chunked prefill)."""
    long = request("long", prompt_of(7, 70, vocab), max_tokens=6)
    return [long] + [
        request(
            f"r{i}",
            prompt_of(100 + i, n, vocab),
            tenant=(TENANT_A, TENANT_B)[i % 2],
            max_tokens=12,
            temperature=(0.0, 0.7)[i % 2],
            seed=i,
        )
        for i, n in enumerate([18, 20, 33, 24, 17, 31, 26, 21])
    ]


@dataclass
class Run:
    results: dict[str, Result]
    injector: FaultInjector
    hit_at: dict[str, int]  # victim → step whose start (or forward) the injection hit
    finished_at: dict[str, int]  # request → step that ended it


def run(engine: Engine, injections: dict[int, Inject]) -> Run:
    """Run the workload, applying `injections[step]` just before that step."""
    out = Run({}, FaultInjector(engine), {}, {})
    for req in workload(engine.scheduler.vocab_size):
        engine.add_request(req)
    step = 0
    while engine.has_unfinished:
        num_logged = len(out.injector.log)
        if step in injections:
            injections[step](out.injector)
        outputs = engine.step()
        collect(out.results, outputs)
        out.hit_at |= {i.request_id: step for i in out.injector.log[num_logged:]}
        out.finished_at |= {o.request_id: step for o in outputs if o.finish_reason is not None}
        step += 1
        assert step < 500
    return out


def assert_pool_restored(engine: Engine) -> None:
    bm = engine.block_manager
    assert bm.num_available_pages == NUM_PAGES
    assert sum(bm.refcounts) == 0 and bm.num_quarantined_pages == 0


SCENARIOS: dict[str, dict[int, Inject]] = {
    "reassign_live_page": {6: lambda f: f.reassign_live_page("r2", new_owner="r5")},
    "reallocate_under_reader": {7: lambda f: f.reallocate_under_reader("r3", new_owner="r6")},
    "corrupt_page_table_entry": {6: lambda f: f.corrupt_page_table_entry("r4", other="r1")},
    "corrupt_expected_tag": {8: lambda f: f.corrupt_expected_tag("r0")},
    "abort_mid_prefill": {1: lambda f: f.abort("long")},
    "abort_mid_decode": {10: lambda f: f.abort("r7")},
    "several_at_once": {
        5: lambda f: f.reassign_live_page("r1", new_owner="r0"),
        6: lambda f: (f.corrupt_expected_tag("r2"), f.abort("r3")),
        8: lambda f: f.reallocate_under_reader("r5", new_owner="r4"),
    },
}


@pytest.mark.parametrize("model_name", MODELS)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_injected_fault_aborts_exactly_its_victim(
    scenario: str, model_name: str, models: ModelShelf, caplog: pytest.LogCaptureFixture
) -> None:
    model = models[model_name]
    clean_engine = make_engine(model, num_pages=NUM_PAGES, max_num_batched_tokens=32)
    clean = run(clean_engine, {}).results
    assert clean_engine.stats.tag_check_aborts == 0

    engine = make_engine(model, num_pages=NUM_PAGES, max_num_batched_tokens=32)
    assert engine.block_manager.num_available_pages == NUM_PAGES
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kumo.engine"):
        faulty = run(engine, SCENARIOS[scenario])
    results, injector = faulty.results, faulty.injector

    injected = [(i.request_id, i.page_id) for i in injector.log if i.kind != "abort"]
    detected = [(m[1], int(m[2])) for rec in caplog.records if (m := DETECTION.search(rec.getMessage()))]
    assert sorted(detected) == sorted(injected)  # 1:1, same request, same page
    assert engine.stats.tag_check_aborts == len(injected)
    aborted_by_client = {i.request_id for i in injector.log if i.kind == "abort"}
    victims = {rid for rid, _ in injected} | aborted_by_client
    assert len(injector.log) == len(victims)  # one injection per victim in these scenarios
    phases = {i.kind: i.phase for i in injector.log}
    if scenario.startswith("abort_mid_"):
        assert phases["abort"] == scenario.removeprefix("abort_mid_")
    else:
        assert "waiting" not in phases.values()
    for rid, r in results.items():
        if rid in victims:
            expected_code = "aborted" if rid in aborted_by_client else "integrity_abort"
            assert r.finish_reason == "abort" and r.error is not None and r.error.code == expected_code
            assert r.token_ids == clean[rid].token_ids[: len(r.token_ids)]  # nothing from a wrong page
            assert len(r.token_ids) < len(clean[rid].token_ids)
            assert faulty.finished_at[rid] == faulty.hit_at[rid]  # detected / aborted within that step
        else:
            assert r.error is None and r.token_ids == clean[rid].token_ids, rid
    assert_pool_restored(engine)


@pytest.mark.parametrize("model_name", MODELS)
def test_clean_runs_never_abort(model_name: str, models: ModelShelf) -> None:
    """Clean runs under pressure (preemption, prefix sharing, chunking): not one false abort."""
    model = models[model_name]
    num_checked = 0
    reference: dict[str, list[int]] | None = None
    for num_pages, budget in ((NUM_PAGES, 32), (7, 16), (NUM_PAGES, 64)):
        # the 7-page pool is for preemption: under the default half-replica share per tenant its
        # two tenants would mostly wait their turn instead
        share = 1.0 if num_pages == 7 else 0.5
        engine = make_engine(model, num_pages=num_pages, max_num_batched_tokens=budget, tenant_share=share)
        first = run(engine, {}).results
        again = run(engine, {}).results  # the same workload again: prefix-cache hits this time
        num_checked += engine.stats.checked_seqs
        assert engine.stats.tag_check_aborts == 0
        assert all(r.error is None for r in [*first.values(), *again.values()])
        reference = reference or {k: r.token_ids for k, r in first.items()}
        # pool size, chunking, preemption and cache hits change no token, greedy or seeded
        assert {k: r.token_ids for k, r in first.items()} == reference
        assert {k: r.token_ids for k, r in again.items()} == reference
        assert engine.block_manager.num_available_pages == num_pages
        if num_pages == 7:
            assert engine.stats.preemptions > 0  # too small to keep pages cached between runs
        else:
            assert engine.stats.prefix_hits > 0
    assert num_checked > 300


def test_an_abort_distrusts_only_the_pages_its_request_holds() -> None:
    """A table gone wrong names a page its request does not hold (here: a page the prefix cache
    keeps for another tenant, held by no one). The abort drops from the cache only what the aborted
    request holds under its tags: the other tenant's entry stays (its prompt hits again), and no
    page ends up in no pool."""
    from backend.engine.sequence import PageRef

    engine = make_engine(num_pages=16)
    bm = engine.block_manager
    assert bm.prefix_cache is not None
    a = prompt_of(1, 40, 64)
    results: dict[str, Result] = {}
    engine.add_request(request("a", a, tenant=TENANT_A, max_tokens=2))
    while engine.has_unfinished:
        collect(results, engine.step())
    cached = [p for p in range(bm.num_pages) if bm.prefix_cache.is_cached(p) and bm.refcounts[p] == 0]
    assert len(cached) == 2  # a's two full prompt pages, held by no one
    available = bm.num_available_pages
    engine.add_request(request("b", prompt_of(2, 40, 64), tenant=TENANT_B, max_tokens=8))
    collect(results, engine.step())  # b admitted and prefilled
    b = engine._seqs["b"]
    b.page_table[1] = PageRef(cached[0], b.page_table[1].tag)  # a bug writes into b's table
    while engine.has_unfinished:
        collect(results, engine.step())
    assert results["b"].error is not None and results["b"].error.code == "integrity_abort"
    assert all(bm.prefix_cache.is_cached(p) for p in cached)
    assert bm.num_available_pages == available
    engine.add_request(request("a2", a, tenant=TENANT_A, max_tokens=2))
    while engine.has_unfinished:
        collect(results, engine.step())
    assert results["a2"].error is None and results["a2"].num_cached_tokens == 32

"""Whole greedy speculative steps on the device (backend/engine/speculative/greedy.py), on the CPU:
the same function the verify graphs capture on CUDA, run eagerly here (and over the graphs' static
buffers with `eager_capture`). Its reference is the host path (acceptance and drafts planned on the
host, forward by forward), and plain decoding's outputs."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from backend.engine.decode_graphs import eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.speculative.accept import accept_greedy
from backend.models.loader import prepare_model
from tests.backend.engine.test_speculative import (
    ARCHS,
    OracleDrafts,
    assert_same_or_tied,
    check_pool,
    engine_for,
    loaded,
    prompts,
)
from tests.backend.engine_helpers import Result, collect, request, run_all

__all__ = ["loaded"]  # the fixture


def graphed(model: Any, k: int, **config: Any) -> Engine:
    """Verify and greedy steps through the graphs' buffers and padding (no graph: eager_capture)."""
    c = EngineConfig.build(**(dict(
        num_pages=96, page_size=8, max_num_batched_tokens=64, max_num_seqs=16, num_speculative_tokens=k,
        speculative_max_seqs=16, speculative_draft_cost=0.25, cuda_graph_batch_sizes=(1, 2, 4, 8, 16),
    ) | config))  # fmt: skip
    return Engine.from_prepared(prepare_model(model, c), c, graph_capture=eager_capture)


def lockstep(fast: Engine, slow: Engine, reqs: list[Any]) -> tuple[dict[str, Result], int]:
    """Both engines step by step over `reqs`: the same outputs, drafts and pool after every step.
    Returns the outputs and how many steps had drafts that differ (fp near-ties across batch shapes)."""
    assert fast.spec is not None and slow.spec is not None
    slow.spec.is_greedy_enabled = False
    for r in reqs:
        fast.add_request(r)
        slow.add_request(r)
    got: dict[str, Result] = {}
    want: dict[str, Result] = {}
    num_differing = 0
    while fast.has_unfinished or slow.has_unfinished:
        collect(got, fast.step())
        collect(want, slow.step())
        check_pool(fast)
        assert {rid: [t.token_ids for t in v.outputs] for rid, v in got.items()} == {
            rid: [t.token_ids for t in v.outputs] for rid, v in want.items()
        }
        num_differing += fast.spec.book.proposed != slow.spec.book.proposed
        fast.spec.book.proposed = dict(slow.spec.book.proposed)  # the next step verifies the same drafts
    assert fast.spec.num_greedy_steps > 0 and slow.spec.num_greedy_steps == 0
    assert fast.stats.spec_verifies == slow.stats.spec_verifies
    assert fast.stats.spec_accepted_tokens == slow.stats.spec_accepted_tokens
    bm = fast.block_manager
    assert bm.num_available_pages == bm.num_pages and bm.num_quarantined_pages == 0
    return got, num_differing


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("is_graphed", [False, True], ids=["eager", "graph-buffers"])
def test_greedy_steps_match_the_host_path(
    loaded: dict[str, Any], arch: str, k: int, is_graphed: bool
) -> None:
    """The model's own (random) drafts: the device's acceptance and drafts are the host path's."""
    model = loaded[arch]
    # a step is a greedy one when every sequence in it is (k drafts, pages past them): few, long requests
    ps = prompts(4, model.config.vocab_size, seed=20 + k)
    reqs = [request(f"r{i}", p, max_tokens=24 + 3 * i) for i, p in enumerate(ps)]
    make = graphed if is_graphed else engine_for
    got, num_differing = lockstep(make(model, k), make(model, k), reqs)
    plain = run_all(engine_for(model, 0), reqs)
    assert {rid: r.token_ids for rid, r in got.items()} == {rid: r.token_ids for rid, r in plain.items()}
    assert num_differing <= 1


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_steps_accept_runs_of_every_length(loaded: dict[str, Any], arch: str) -> None:
    """Oracle drafts (the plain run's tokens, each wrong with probability 0.3): every accepted length
    0 … K, plain decoding's outputs, and the pool as it was after every step."""
    model = loaded[arch]
    ps = prompts(4, model.config.vocab_size, seed=9)
    reqs = [request(f"r{i}", p, max_tokens=30 + i) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3)
    OracleDrafts(engine, plain, p_wrong=0.3)
    assert engine.spec is not None
    lengths: list[int] = []
    run_greedy = engine.spec._run_greedy

    def counting(*args: Any) -> Any:
        results = run_greedy(*args)
        lengths.extend(r.num_new_tokens for r in results)
        return results

    engine.spec._run_greedy = counting  # type: ignore[method-assign]
    for r in reqs:
        engine.add_request(r)
    got: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(got, engine.step())
        check_pool(engine)
    assert {rid: r.token_ids for rid, r in got.items()} == {rid: r.token_ids for rid, r in plain.items()}
    assert set(lengths) == {1, 2, 3, 4}
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


def test_acceptance_on_the_device_is_the_host_rule() -> None:
    """The device's accepted count against `accept_greedy` over random drafts and targets."""
    from kernels.verify_accept import accepted_count

    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3):
        targets = torch.randint(0, 3, (200, k + 1), generator=g)
        drafts = torch.randint(0, 3, (200, k), generator=g)
        a = accepted_count(targets, drafts).tolist()
        for b in range(200):
            want = accept_greedy(drafts[b].tolist(), targets[b].tolist())
            assert targets[b, : a[b] + 1].tolist() == want


@pytest.mark.parametrize("arch", ARCHS)
def test_a_tag_fault_in_a_greedy_step_aborts_only_that_request(loaded: dict[str, Any], arch: str) -> None:
    """A chained draft forward of a greedy step finds the victim's page handed to another request:
    the victim alone is aborted, the others decode as plain decoding, the pool as it was."""
    from tests.backend.engine_faults import FaultInjector

    model = loaded[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=14) for i, p in enumerate(prompts(3, model.config.vocab_size, seed=11))
    ]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3)
    spec = engine.spec
    assert spec is not None
    injector = FaultInjector(engine)
    forward_mtp = model.model.forward_mtp
    in_greedy = [False]
    faults = itertools.count()
    run_greedy = spec._run_greedy

    def flagging(*args: Any) -> Any:
        in_greedy[0] = True
        try:
            return run_greedy(*args)
        finally:
            in_greedy[0] = False

    def faulty_forward_mtp(batch: Any, hidden: torch.Tensor, depth: int, step: Any = None, **kw: Any) -> Any:
        if in_greedy[0] and depth == 1 and next(faults) == 0:  # the first greedy step's chained draft
            victim = injector.seq("r0")
            page = victim.page_table[victim.num_computed_tokens // engine.block_manager.page_size].page_id
            injector._give(page, injector.seq("r1"))
            engine.runner.apply_tag_updates(engine.block_manager.take_tag_updates())
        return forward_mtp(batch, hidden, depth, step, **kw)

    spec._run_greedy = flagging  # type: ignore[method-assign]
    model.model.forward_mtp = faulty_forward_mtp
    try:
        results = run_all(engine, reqs)
    finally:
        del model.model.forward_mtp
    assert next(faults) > 1  # the fault was injected inside a greedy step
    assert results["r0"].error is not None and results["r0"].error.code == "integrity_abort"
    for rid in ("r1", "r2"):
        assert results[rid].error is None and results[rid].token_ids == plain[rid].token_ids
    assert engine.stats.tag_check_aborts == 1
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


def test_no_eager_greedy_steps_beside_verify_graphs(loaded: dict[str, Any]) -> None:
    """Greedy steps that failed to capture while the verify graphs did: the host path (its verify,
    depth-0 and draft graphs) serves them, not an eager greedy step."""
    model = loaded["deepseek_v3"]
    engine = graphed(model, 3)
    assert engine.spec is not None and engine.spec.is_greedy_enabled
    forwards = engine.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None and forwards.graphs.has_greedy
    forwards.graphs.disable_greedy("test")
    assert not type(engine.spec)(engine.runner, engine.block_manager, can_match_stops=False).is_greedy_enabled


@pytest.mark.slow
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_steps_identical_over_hundreds_of_prompts(loaded: dict[str, Any], arch: str) -> None:
    """256 prompts per architecture, fp32, K = 3 always, without logprobs (so greedy steps run, through
    the graphs' buffers and staging), four at a time: half drafted by the random MTP layer, half by
    oracle drafts; plain decoding's tokens up to a tie (its top two log-probs within 1e-5), the pool
    whole after each batch."""
    model = loaded[arch]
    ps = prompts(256, model.config.vocab_size, seed=300)
    reqs = [request(f"r{i}", p, max_tokens=4 + i % 29) for i, p in enumerate(ps)]
    with_logprobs = [  # the plain run's top two log-probs tell a tie
        request(
            r.request_id, r.prompt_token_ids, max_tokens=r.sampling.max_tokens, logprobs=True, top_logprobs=2
        )
        for r in reqs
    ]
    plain: dict[str, Result] = {}
    for start in range(0, len(reqs), 16):
        plain |= run_all(engine_for(model, 0), with_logprobs[start : start + 16])
    ties = num_greedy = 0
    for half, oracle in ((reqs[:128], False), (reqs[128:], True)):
        engine = graphed(model, 3, speculative_adaptive=False)
        if oracle:
            OracleDrafts(engine, plain, p_wrong=0.3, seed=1)
        for start in range(0, len(half), 4):
            batch = half[start : start + 4]
            spec = run_all(engine, batch)
            ties += sum(
                assert_same_or_tied(spec[r.request_id], plain[r.request_id], r.request_id) for r in batch
            )
            assert engine.block_manager.num_available_pages == engine.block_manager.num_pages
        assert engine.spec is not None
        num_greedy += engine.spec.num_greedy_steps
    assert ties <= 2 and num_greedy > 100


@pytest.mark.parametrize("arch", ARCHS)
def test_a_spare_draft_page_handed_away_between_steps_aborts_only_its_holder(
    loaded: dict[str, Any], arch: str
) -> None:
    """Between two greedy steps the page r0 keeps for its next drafts (past its tokens) is handed to
    another request: the next step's draft writes into it fail the tag check, r0 alone is aborted,
    the others decode as plain decoding, and no page leaks."""
    from tests.backend.engine_faults import FaultInjector

    model = loaded[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=30) for i, p in enumerate(prompts(3, model.config.vocab_size, seed=11))
    ]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3, speculative_adaptive=False)
    bm, injector = engine.block_manager, FaultInjector(engine)
    for r in reqs:
        engine.add_request(r)
    results: dict[str, Result] = {}
    spec = engine.spec
    assert spec is not None
    stolen = -1
    while engine.has_unfinished:
        collect(results, engine.step())
        victim = engine._seqs.get("r0")
        if (
            stolen < 0
            and spec.num_greedy_steps > 0
            and victim is not None
            and len(victim.page_table) > bm.num_pages_for(victim.num_tokens)
        ):
            assert "r0" in bm.spare_holders
            stolen = victim.page_table[-1].page_id
            injector._give(stolen, injector.seq("r1"))
    assert stolen >= 0
    assert results["r0"].error is not None and results["r0"].error.code == "integrity_abort"
    for rid in ("r1", "r2"):
        assert results[rid].error is None and results[rid].token_ids == plain[rid].token_ids
    assert engine.stats.tag_check_aborts == 1
    assert bm.num_available_pages == bm.num_pages and not bm.spare_holders

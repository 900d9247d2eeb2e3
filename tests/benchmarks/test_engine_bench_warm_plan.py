"""A warm-up shorter than the workload (`benchmarks.engine.warm_plan`): the scheduler's plan of the
timed run's step shapes is what the timed run then does, and the short pass plus its probes runs every
one of them, where the short pass alone misses some."""

from __future__ import annotations

import pytest

from backend.engine.decode_graphs import eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from benchmarks.engine import method, warm_plan
from benchmarks.engine.offline import run_offline
from tests.benchmarks.test_engine_bench_method import VOCAB, ShapeSpy

# 6 requests of 40 + 12 tokens need 78 pages of 4; the pool holds 36: requests queue, decodes preempt
POOL, PAGE, CHUNK, NUM_SEQS = 36, 4, 32, 6
WORKLOAD = {"concurrency": NUM_SEQS, "input_len": 40, "vocab_size": VOCAB}


def engine() -> tuple[Engine, ShapeSpy]:
    spy = ShapeSpy()
    config = EngineConfig.build(
        page_size=PAGE, num_pages=POOL, max_num_seqs=NUM_SEQS, max_num_batched_tokens=CHUNK,
        enable_prefix_cache=False, seed=0,
    )  # fmt: skip
    return Engine(spy, config, vocab_size=VOCAB, context_window=512, graph_capture=eager_capture), spy


def test_the_plan_is_the_timed_runs_step_shapes_and_probes_fill_what_a_short_pass_missed() -> None:
    plan = warm_plan.planned_shapes(
        num_pages=POOL, page_size=PAGE, concurrency=NUM_SEQS, chunk=CHUNK, input_len=40, output_len=12
    )
    eng, spy = engine()
    short = run_offline(eng, variant="short", output_len=3, **WORKLOAD)  # type: ignore[arg-type]
    missed = method.missing_shapes(short.extra["step_shapes"], plan)
    assert missed  # the short pass alone would leave timed shapes cold
    probed: list[list[int]] = []
    for p, d in missed:
        probed += [list(s) for s in warm_plan.probe(eng, (p, d), variant="probe")]
    assert method.missing_shapes(probed, missed) == []  # each probe ran its shape
    warm_seen = set(spy.seen)
    spy.seen.clear()

    timed = run_offline(eng, variant="timed", output_len=12, seed=5, **WORKLOAD)  # type: ignore[arg-type]
    assert timed.preemptions > 0  # the pool-limited pattern whose shapes a short pass misses
    assert {tuple(s) for s in timed.extra["step_shapes"]} == {tuple(s) for s in plan}
    assert method.missing_shapes(short.extra["step_shapes"] + probed, timed.extra["step_shapes"]) == []
    # what the forward was given: every token count of the timed steps ran in the warm-up
    assert {t for t, _ in spy.seen} <= {t for t, _ in warm_seen}


def test_a_probe_leaves_the_engine_idle_and_refuses_a_shape_over_the_budget() -> None:
    eng, _ = engine()
    assert warm_plan.probe(eng, (0, 4), variant="d") == [(4, 0), (0, 4)]
    assert warm_plan.probe(eng, (17, 0), variant="p") == [(17, 0)]
    assert not eng.has_unfinished and eng.block_manager.num_free_pages == POOL
    with pytest.raises(AssertionError):
        warm_plan.probe(eng, (CHUNK, 1), variant="over")

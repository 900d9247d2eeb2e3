"""The method of every engine comparison (issue 25): A/B/B/A rounds, repeats and their summary entry,
a warm-up that runs every step shape the timed run will, and the fresh-machine flag."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from backend.engine.decode_graphs import eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.forward_batch import ForwardBatch
from benchmarks.engine import method
from benchmarks.engine.null_model import NullModel
from benchmarks.engine.offline import run_offline

VOCAB = 64


class ShapeSpy(torch.nn.Module):
    """`NullModel` that writes down what each forward was given: (tokens, sequences)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = NullModel(VOCAB)
        self.seen: list[tuple[int, int]] = []

    def cache_specs(self):  # type: ignore[no-untyped-def]
        return self.inner.cache_specs()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.seen.append((int(batch.input_ids.shape[0]), int(batch.query_start.shape[0]) - 1))
        return self.inner(batch)


def spy_engine(*, chunk: int = 32, num_pages: int = 64, max_num_seqs: int = 8) -> tuple[Engine, ShapeSpy]:
    spy = ShapeSpy()
    config = EngineConfig.build(
        page_size=4, num_pages=num_pages, max_num_seqs=max_num_seqs, max_num_batched_tokens=chunk,
        enable_prefix_cache=False, seed=0,
    )  # fmt: skip
    return Engine(spy, config, vocab_size=VOCAB, context_window=512, graph_capture=eager_capture), spy


def test_rounds_run_a_b_b_a_and_each_gives_one_drift_free_ratio() -> None:
    """Side A takes 2 s a run and B 1 s, on a machine that slows by 10% a run: each round's ratio of
    times is exactly 2 (the drift cancels in (a1 + a2) / (b1 + b2)), where the plain A/B order reads less."""
    ran: list[str] = []
    clock = itertools.count()

    def run(side: str) -> dict[str, float]:
        ran.append(side)
        drift = 1.0 + 0.1 * next(clock)
        return {"wall_s": (2.0 if side == "A" else 1.0) * drift}

    rounds = method.interleave(run, lambda r: r["wall_s"], num_rounds=3, time_left=lambda: 1e9)
    assert ran == ["A", "B", "B", "A"] * 3 == method.order(3)
    assert [r["order"] for r in rounds] == [["A", "B", "B", "A"]] * 3
    assert [[x["side"] for x in r["runs"]] for r in rounds] == [["A", "B", "B", "A"]] * 3
    assert [r["ratio"] for r in rounds] == pytest.approx([2.0, 2.0, 2.0])
    assert 2.0 * 1.0 / 1.1 < 1.9  # what A then B of the first two runs would have said
    # each round's noise floor: its B runs 1.1 and 1.2 (round 1) apart by one step of drift
    first = rounds[0]["same_side_spread"]
    assert first["B"] == pytest.approx(1.2 / 1.1 - 1) and first["A"] == pytest.approx(1.3 / 1.0 - 1)


def test_the_summary_entry_is_the_median_of_the_rounds_with_their_range() -> None:
    entry = method.summary_entry([1.5, 1.2, 1.4, 3.0])
    assert entry == {"value": pytest.approx(1.45), "samples": [1.5, 1.2, 1.4, 3.0], "spread": [1.2, 3.0]}
    assert set(entry) == {"value", "samples", "spread"}


def test_no_round_starts_that_would_not_fit_the_time_left() -> None:
    left = iter([100.0, 60.0, 20.0])  # at the start and after each round: 40 s a round

    def time_left() -> float:
        return next(left)

    rounds = method.interleave(lambda s: {"x": 1.0}, lambda r: r["x"], num_rounds=5, time_left=time_left)
    assert len(rounds) == 2  # the third would start with 20 s left, after a round of 40
    assert method.interleave(lambda s: {"x": 1.0}, lambda r: r["x"], num_rounds=3, time_left=lambda: 5.0,
                             first_round_s=10.0) == []  # fmt: skip


def test_a_warm_pass_of_the_same_run_covers_every_step_shape_and_the_old_warm_up_did_not() -> None:
    """The timed run: 6 requests of 40 / 12 through 32-token steps, so prompt chunks ride beside
    different numbers of decode rows, and decode narrows as requests finish. The shapes the engine's
    forward received show the warm pass ran them all; the former warm-up (the same run, 8 output
    tokens) missed some, and `missing_shapes` over the loop's own record says so too."""
    engine, spy = spy_engine()
    args = dict(concurrency=6, input_len=40, vocab_size=VOCAB)

    old_warm = run_offline(engine, variant="old", output_len=2, **args)  # type: ignore[arg-type]
    seen_old = set(spy.seen)
    spy.seen.clear()
    warm = run_offline(engine, variant="warm", output_len=12, **args)  # type: ignore[arg-type]
    seen_warm = set(spy.seen)
    spy.seen.clear()
    timed = run_offline(engine, variant="timed", output_len=12, seed=5, **args)  # type: ignore[arg-type]
    seen_timed = set(spy.seen)

    assert seen_timed <= seen_warm
    assert not seen_timed <= seen_old
    shapes = timed.extra["step_shapes"]
    assert method.missing_shapes(warm.extra["step_shapes"], shapes) == []
    assert method.missing_shapes(old_warm.extra["step_shapes"], shapes) != []
    # the loop's (prefill tokens, decode rows) add up to the tokens the forward was given; a pure
    # decode step runs padded to its CUDA-graph bucket (here `eager_capture`, the graphs' buffers)
    buckets = engine.config.graph_batch_sizes()
    forward_tokens = {p + d if p else min(b for b in buckets if b >= d) for p, d in shapes}
    assert forward_tokens == {t for t, _ in seen_timed}
    assert any(p > 0 and d > 0 for p, d in shapes)  # mixed steps, the shapes a short warm-up misses
    assert {d for p, d in shapes if p == 0} == {1, 2, 3, 5}  # decode, narrowing as requests finish


def test_steady_decode_rate_comes_from_the_widest_pure_decode_steps() -> None:
    engine, _ = spy_engine()
    r = run_offline(engine, variant="v", concurrency=3, input_len=8, output_len=6, vocab_size=VOCAB)
    assert r.extra["steady_decode_rows"] == 3
    assert r.extra["steady_decode_tok_s"] == pytest.approx(3e3 / r.extra["steady_decode_step_ms_p50"])


def test_a_fresh_machine_is_the_first_process_on_its_compile_cache(tmp_path: Path) -> None:
    cache = tmp_path / "triton"
    first = method.machine_state(cache)
    assert first["is_fresh"] and first["compile_cache_entries_at_start"] == 0 and first["first_run"] is None
    (cache / "abc123").mkdir()  # a kernel compiled by that process
    second = method.machine_state(cache)
    assert not second["is_fresh"] and second["compile_cache_entries_at_start"] == 1
    assert second["first_run"]  # when the first one ran
    warm_cache = tmp_path / "used"  # entries from something else, but no benchmark process yet
    (warm_cache / "k").mkdir(parents=True)
    third = method.machine_state(warm_cache)
    assert third["is_fresh"] and third["compile_cache_entries_at_start"] == 1

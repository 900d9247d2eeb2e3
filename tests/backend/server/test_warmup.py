"""Warm before ready: the start-up warm-up runs every step shape the engine will take (what a GPU
compiles), leaves the pool empty, and costs the CPU one tiny step; the compile cache lives in the
data dir, set by the settings object."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from backend.engine.decode_graphs import eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.forward_batch import ForwardBatch
from backend.server.settings import build_settings
from backend.server.warmup import warm_up
from benchmarks.engine.null_model import NullModel
from benchmarks.engine.offline import run_offline

VOCAB = 64


class ShapeSpy(torch.nn.Module):
    """`NullModel` that writes down each forward's (tokens, sequences, is decode only)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = NullModel(VOCAB)
        self.seen: set[tuple[int, int, bool]] = set()

    def cache_specs(self):  # type: ignore[no-untyped-def]
        return self.inner.cache_specs()

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.seen.add(
            (int(batch.input_ids.shape[0]), int(batch.query_start.shape[0]) - 1, batch.is_decode_only)
        )
        return self.inner(batch)


def spy_engine(num_pages: int = 256) -> tuple[Engine, ShapeSpy]:
    spy = ShapeSpy()
    config = EngineConfig.build(
        page_size=4, num_pages=num_pages, max_num_seqs=20, max_num_batched_tokens=48, seed=0
    )  # graph buckets 1, 2, 4, 8, 16, 20
    return Engine(spy, config, vocab_size=VOCAB, context_window=512, graph_capture=eager_capture), spy


def test_the_full_warm_up_runs_each_decode_bucket_mixed_step_and_prefill_size() -> None:
    engine, spy = spy_engine()
    steps0 = engine.stats.steps
    warm = warm_up(engine, is_full=True)
    assert warm.num_steps == engine.stats.steps - steps0 > 0 and warm.seconds > 0
    buckets = engine.config.graph_batch_sizes()
    assert buckets == [1, 2, 4, 8, 16, 20]
    decode = {t for t, b, only in spy.seen if only}
    assert decode >= set(buckets)  # every graph bucket replayed
    mixed = {b - 1 for t, b, only in spy.seen if t == 48 and b > 1}  # a full budget beside b - 1 decode rows
    assert mixed >= set(buckets[:-1])
    prefill = {t for t, b, only in spy.seen if b == 1 and not only}
    assert prefill >= {2, 3, 4, 7, 8, 15, 16, 31, 32, 47, 48}
    load = engine.load()  # nothing left behind
    assert (load.running, load.waiting, load.free_pages) == (0, 0, load.total_pages)


def test_a_workload_after_the_warm_up_takes_no_decode_shape_it_missed() -> None:
    """Decode steps of 12 down to 1 rows replay buckets 16, 8, 4, 2, 1: all run at start-up. (Mixed
    steps beside other counts of prompts are not all enumerable; the benchmarks warm those with a
    whole untimed run, `benchmarks.engine.method`.)"""
    engine, spy = spy_engine()
    warm_up(engine, is_full=True)
    warmed = set(spy.seen)
    spy.seen.clear()
    run_offline(engine, variant="v", concurrency=12, input_len=40, output_len=30, vocab_size=VOCAB)
    decode = {s for s in spy.seen if s[2]}
    assert {t for t, _, _ in decode} >= {16, 8}
    assert decode <= warmed


def test_the_warm_up_skips_what_the_pool_cannot_hold() -> None:
    engine, _ = spy_engine(num_pages=10)  # 40 tokens: no 48-token prompt, no 20 decoding requests
    warm = warm_up(engine, is_full=True)
    assert warm.num_steps > 0
    assert engine.load().free_pages == 10


def test_the_cpu_warm_up_is_one_step() -> None:
    engine, spy = spy_engine()
    warm = warm_up(engine, is_full=False)
    assert (warm.num_steps, warm.num_requests) == (1, 1) and len(spy.seen) == 1


def test_the_compile_cache_is_in_the_data_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    base = ["--model", "m", "--port", "1", "--secret", "s" * 16]
    assert build_settings(base).compile_cache_dir is None
    build_settings(base).apply_compile_cache()
    assert "TRITON_CACHE_DIR" not in os.environ  # Triton's own default then
    settings = build_settings([*base, "--data-dir", str(tmp_path)])
    assert settings.compile_cache_dir == tmp_path / "compile-cache" / "triton"
    settings.apply_compile_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "compile-cache" / "triton")


@pytest.mark.gpu
def test_on_cuda_a_workload_after_the_warm_up_compiles_no_kernel(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tiny random Kimi K2.6 (INT4 experts) on the GPU: after the warm-up, a chunked workload of 12
    requests (prompt chunks beside decode rows, decode narrowing) adds nothing to the compile cache."""
    from benchmarks.engine.geometry import make_geometry
    from benchmarks.engine.weights import build_random_model

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    geometry = make_geometry("kimi-k2.6", 2, tiny=True)
    vocab = geometry.model_config.vocab_size
    config = EngineConfig.build(page_size=16, num_pages=512, max_num_seqs=16, max_num_batched_tokens=256)
    engine = Engine(
        build_random_model(geometry, "int4", device="cuda"),  # type: ignore[arg-type]
        config,
        vocab_size=vocab,
        context_window=4096,
        model_dtype=torch.bfloat16,
        device="cuda",
    )
    warm_up(engine, is_full=True)
    torch.cuda.synchronize()
    compiled = sorted(p.name for p in cache.rglob("*"))
    run_offline(engine, variant="v", concurrency=12, input_len=300, output_len=40, vocab_size=vocab)
    torch.cuda.synchronize()
    assert sorted(p.name for p in cache.rglob("*")) == compiled


def test_a_speculative_warm_up_sweeps_every_draft_length_and_catch_up() -> None:
    """With `--speculative mtp:3`, the full warm-up also decodes one request at a time, greedy and
    sampled, short and long prompts, through every draft length 1 … 3, plain steps and the catch-ups
    after them (the steps outside the whole-step graphs, whose kernels follow the length); the pool
    is empty after, the policy free again, and the outputs of a later workload are plain decoding's."""
    from backend.engine.speculative.policy import PRIOR_ACCEPTANCE
    from tests.backend.engine.test_draft_policy import toy
    from tests.backend.engine_helpers import request, run_all

    engine = toy(3)
    warm = warm_up(engine, is_full=True)
    assert engine.spec is not None and engine.spec.policy.forced_k is None
    # what the policy learned from random prompts and forced lengths is dropped: serving starts from
    # the priors (the sweep's verifies of random tokens accepted few drafts)
    assert engine.spec.policy.acceptance == [PRIOR_ACCEPTANCE] * 3 and engine.spec.policy.num_probes == 0
    assert engine.stats.spec_verifies > 0
    assert {0, 1, 2, 3} <= set(warm.spec_steps) and warm.spec_steps[-1] >= 2  # catch-ups, each prompt
    assert not engine.has_unfinished
    load = engine.load()  # nothing left behind: no page, no draft page
    assert (load.running, load.waiting, load.free_pages) == (0, 0, load.total_pages)
    reqs = [request(f"r{i}", [i % 16] * 5, max_tokens=20) for i in range(6)]
    got, plain = run_all(engine, reqs), run_all(toy(0), reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert warm_up(toy(0), is_full=True).spec_steps == {}

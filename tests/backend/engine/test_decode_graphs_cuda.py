"""Decode steps from CUDA graphs against the eager GPU path, on random checkpoints of each served
architecture (device tool only; the bucketing and padding logic is tested on the CPU in
test_decode_graphs.py).

Greedy tokens must agree. Random small models have near-flat distributions (top-2 gaps of a few
hundredths of a nat), and the graph path is not bit-identical to the eager one (padded batches
change GEMM shapes; unquantized experts run the every-expert form in a graph), so a token may
differ only at a near-tie: each run's token among the other's TOP best, within NEAR_TIE of the
other's choice, after which the two contexts differ and comparison stops. Garbage from a graph would
fail at its first decode step. Run with `-s` for the per-step decode latency table.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.models.loader import load_model
from backend.quant.kv_scales import calibrate
from backend.tools.random_checkpoint import KINDS, write_random_checkpoint
from tests.backend.engine_faults import FaultInjector
from tests.backend.engine_helpers import Result, collect, prompt_of, request

pytestmark = pytest.mark.gpu

NEAR_TIE = 0.15  # nats between a run's top-2 log-probs for a swap to count as a tie
LOGPROB_TOL = 0.15  # nats between the runs' log-probs of the same chosen token
NUM_TOKENS = 32
TOP = 8  # runner-ups reported per token: exact bf16 ties of three or more tokens happen
KV_DTYPES = {"bf16": "auto", "fp8": "float8_e4m3fn"}


class Shelf:
    """One bf16 model per kind on the GPU, and one engine per (kind, kv dtype, graphs on/off)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.models: dict[str, Any] = {}
        self.engines: dict[tuple[str, str, bool], Engine] = {}

    def engine(self, kind: str, kv: str, graphs: bool) -> Engine:
        key = (kind, kv, graphs)
        if key not in self.engines:
            if kind not in self.models:
                path = write_random_checkpoint(kind, self.root / kind, dtype=torch.bfloat16)
                self.models[kind] = load_model(path, dtype=torch.bfloat16, device="cuda")
            self.engines[key] = build_engine(self.models[kind], kv, graphs)
        return self.engines[key]


def build_engine(loaded: Any, kv: str, graphs: bool) -> Engine:
    vocab = loaded.config.vocab_size
    scales = None
    if kv == "fp8":  # calibrated here, as a checkpoint without scales would be (no warning)
        scales = calibrate(loaded.model, [prompt_of(90, 64, vocab)], model_dtype=torch.bfloat16)
    config = EngineConfig.build(
        num_pages=256,
        page_size=16,
        kv_dtype=KV_DTYPES[kv],
        max_num_seqs=8,  # buckets 1, 2, 4, 8
        max_num_batched_tokens=512,
        context_window=256,  # page tables 16 pages wide in the graphs
        enable_prefix_cache=False,
        cuda_graphs=graphs,
    )
    return Engine(
        loaded.model,
        config,
        vocab_size=vocab,
        context_window=loaded.config.max_position_embeddings,
        model_dtype=torch.bfloat16,
        device="cuda",
        kv_scales=scales,
    )


@pytest.fixture(scope="module")
def shelf(tmp_path_factory: pytest.TempPathFactory) -> Shelf:
    return Shelf(Path(tmp_path_factory.mktemp("graph_cuda_models")))


def requests(num_seqs: int, vocab: int, tag: str) -> list:
    return [
        request(
            f"{tag}-r{i}",
            prompt_of(i, 17 + 11 * i, vocab),
            max_tokens=NUM_TOKENS,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=TOP,
        )
        for i in range(num_seqs)
    ]


def run_timed(engine: Engine, reqs: list) -> tuple[dict[str, Result], list[float]]:
    """Results, and the wall time of every step in which every request was decoding."""
    results: dict[str, Result] = {}
    for req in reqs:
        engine.add_request(req)
    decode_s = []
    while engine.has_unfinished:
        is_decode = len(results) == len(reqs) and all(r.finish_reason is None for r in results.values())
        collect(results, engine.step())
        if is_decode and all(len(r.token_ids) >= 2 for r in results.values()):
            decode_s.append(engine.stats.last_step_s)
    return {k.split("-", 1)[1]: v for k, v in results.items()}, decode_s


def assert_same_greedy(want: Result, got: Result, what: str) -> int:
    """Equal tokens with close log-probs, up to a near-tie swap; returns the tokens that agreed."""
    assert len(want.token_ids) == len(got.token_ids), what
    for i, (w, g) in enumerate(zip(want.token_ids, got.token_ids, strict=True)):
        lw, lg = want.logprobs[i], got.logprobs[i]
        if w != g:  # each run's token must be among the other's best, within NEAR_TIE of its choice
            top_w = {t.token_id: t.logprob for t in lw.top}
            top_g = {t.token_id: t.logprob for t in lg.top}
            assert g in top_w and w in top_g, f"{what}: token {i} is {g}, not {w}: {top_w} {top_g}"
            assert top_w[w] - top_w[g] < NEAR_TIE and top_g[g] - top_g[w] < NEAR_TIE, f"{what}: token {i}"
            return i
        assert abs(lw.logprob - lg.logprob) < LOGPROB_TOL, f"{what}: token {i} log-prob"
    return len(want.token_ids)


@pytest.mark.parametrize("kv", list(KV_DTYPES))
@pytest.mark.parametrize("kind", KINDS)
def test_graphs_match_eager(shelf: Shelf, kind: str, kv: str) -> None:
    eager, graphed = shelf.engine(kind, kv, False), shelf.engine(kind, kv, True)
    graphs = graphed.runner.graphs
    assert eager.runner.graphs is None
    assert graphs is not None and graphs.is_enabled, graphs and graphs.disabled_reason
    vocab = shelf.models[kind].config.vocab_size
    rows = []
    for num_seqs in (1, 3, 8):
        replays = graphs.num_replays
        want, eager_s = run_timed(eager, requests(num_seqs, vocab, "eager"))
        got, graph_s = run_timed(graphed, requests(num_seqs, vocab, "graph"))
        assert graphs.num_replays - replays >= NUM_TOKENS - 2  # every pure-decode step replayed
        agreed = [assert_same_greedy(want[r], got[r], f"{kind} {kv} B={num_seqs} {r}") for r in want]
        eager_ms, graph_ms = 1e3 * statistics.median(eager_s), 1e3 * statistics.median(graph_s)
        rows.append(f"{kind:10} kv={kv:4} B={num_seqs}: eager {eager_ms:7.2f} ms/step, graphs "
                    f"{graph_ms:7.2f} ms/step ({eager_ms / graph_ms:4.1f}x); tokens agreed {sum(agreed)}/"
                    f"{NUM_TOKENS * num_seqs}")  # fmt: skip
    print("\n" + "\n".join(rows))


@pytest.mark.parametrize("kind", KINDS)
def test_tag_fault_mid_decode_is_caught_with_graphs(shelf: Shelf, kind: str) -> None:
    engine = shelf.engine(kind, "fp8", True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.is_enabled, graphs and graphs.disabled_reason
    vocab = shelf.models[kind].config.vocab_size
    clean, _ = run_timed(engine, requests(3, vocab, "clean"))
    results: dict[str, Result] = {}
    for req in requests(3, vocab, "fault"):
        engine.add_request(req)
    while len(results.get("fault-r1", Result()).token_ids) < 6:
        collect(results, engine.step())
    FaultInjector(engine).reassign_live_page("fault-r1", "fault-r2")  # r1's first page is r2's now
    replays, aborts = graphs.num_replays, engine.stats.tag_check_aborts
    collect(results, engine.step())  # a pure-decode step: replayed, and the kernels see the new tag
    assert graphs.num_replays == replays + 1 and engine.stats.tag_check_aborts == aborts + 1
    victim = results["fault-r1"]
    assert victim.finish_reason == "abort" and victim.error is not None
    assert victim.error.code == "integrity_abort"
    assert victim.token_ids == clean["r1"].token_ids[: len(victim.token_ids)]
    while engine.has_unfinished:
        collect(results, engine.step())
    assert_same_greedy(clean["r0"], results["fault-r0"], f"{kind} r0 beside the fault")


def test_capture_runs_without_garbage_collection() -> None:
    """A collection mid-capture may run a finalizer that frees a CUDA resource and aborts the process
    (a verify-graph capture died so on an H100): the capture holds the collector off, warm-up and
    replay do not, and it is back on afterwards."""
    import gc

    from backend.engine.decode_graphs import CudaGraphCapture

    seen: list[bool] = []
    x = torch.ones(4, device="cuda")

    def step() -> torch.Tensor:
        seen.append(gc.isenabled())
        return x * 2

    assert gc.isenabled()
    replay = CudaGraphCapture(torch.device("cuda"))(step)
    assert seen == [True, False]  # the warm-up collects as usual, the capture does not
    assert gc.isenabled()
    assert torch.equal(replay(), torch.full((4,), 2.0, device="cuda"))

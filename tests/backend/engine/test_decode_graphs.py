"""Decode graphs' bucketing and padding on the CPU: `eager_capture` runs the static buffers and the
padding rows without a graph, so everything but the CUDA capture itself is checked against the
plain eager engine (the capture is checked on the device by test_decode_graphs_cuda.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from backend.engine.decode_graphs import (
    PAST_TAG,
    SCRATCH_TAG,
    DecodeGraphs,
    Replay,
    eager_capture,
    no_collection,
)
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.forward_batch import ForwardBatch, HostBatch, KVCache
from backend.engine.sync_free import sync_free
from backend.models.layers.moe import Experts
from backend.server.settings import build_settings
from benchmarks.engine.cli import parser as bench_parser
from benchmarks.engine.offline import engine_config
from kernels.paged_gather import check_tags_ref
from tests.backend.engine_faults import FaultInjector
from tests.backend.engine_helpers import (
    MODELS,
    ModelShelf,
    Result,
    collect,
    make_engine,
    prompt_of,
    request,
    run_all,
    vocab_of,
)
from tests.backend.engine_tiny_model import TinyPagedModel

BUCKETS = (1, 2, 4, 8)
NUM_PAGES = 64


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> ModelShelf:
    return ModelShelf(Path(tmp_path_factory.mktemp("graph_models")))


def engines(model: object, **config: object) -> tuple[Engine, Engine]:
    """(plain eager, eager over the decode graphs' static buffers) with the same settings."""
    values = {"num_pages": NUM_PAGES, "max_num_seqs": 8, "cuda_graph_batch_sizes": BUCKETS} | config
    return make_engine(model, **values), make_engine(model, graph_capture=eager_capture, **values)


def batch_of(n: int, vocab: int) -> list:
    # prompt lengths straddle page edges (page size 16), outputs cross into new pages
    return [
        request(f"r{i}", prompt_of(i, 5 + 7 * i, vocab), max_tokens=12, logprobs=True, top_logprobs=2)
        for i in range(n)
    ]


def run_checking_padding(engine: Engine, requests: list) -> dict[str, Result]:
    """`run_all`, asserting after every step that no row of the graphs' buffers (padding included)
    was flagged by a tag check."""
    graphs = engine.runner.graphs
    assert graphs is not None
    results: dict[str, Result] = {}
    for req in requests:
        engine.add_request(req)
    while engine.has_unfinished:
        collect(results, engine.step())
        assert not graphs.tag_mismatch.any()
    return results


@pytest.mark.parametrize(
    ("model_name", "check_tags"), [(m, True) for m in MODELS] + [("tiny", False), ("glm4_moe", False)]
)
@pytest.mark.parametrize("num_seqs", [1, 2, 3, 5, 8])
def test_graph_path_equals_eager(
    models: ModelShelf, model_name: str, check_tags: bool, num_seqs: int
) -> None:
    model = models[model_name]
    plain, graphed = engines(model, check_page_tags=check_tags)  # off: a stray padding write would land
    want = run_all(plain, batch_of(num_seqs, vocab_of(model)))
    got = run_checking_padding(graphed, batch_of(num_seqs, vocab_of(model)))
    assert graphed.runner.graphs is not None and graphed.runner.graphs.num_replays > 0
    assert plain.runner.graphs is None
    for rid, w in want.items():
        g = got[rid]
        assert (g.token_ids, g.finish_reason, g.error) == (w.token_ids, w.finish_reason, w.error), rid
        torch.testing.assert_close(
            [lp.logprob for lp in g.logprobs], [lp.logprob for lp in w.logprobs], atol=1e-4, rtol=1e-4
        )
    # padding rows wrote no real page: every page of the pool holds what the eager run wrote
    assert graphed.runner.kv_cache.num_pages == NUM_PAGES + 1
    for layer_p, layer_g in zip(plain.runner.kv_cache.layers, graphed.runner.kv_cache.layers, strict=True):
        for name, cache in layer_p.items():
            torch.testing.assert_close(layer_g[name][:NUM_PAGES], cache, atol=1e-5, rtol=1e-5)
    assert graphed.stats.tag_check_aborts == 0


def test_dsa_steps_within_index_topk_replay_the_narrow_graphs(tmp_path: Path) -> None:
    """GLM-5 with index_topk 32 (two pages of 16): each bucket is captured at two widths; steps whose
    sequences are all within 32 tokens replay the narrow graph (dense MLA, no indexer), longer ones
    the full width's (selection), and both give the eager engine's tokens and log-probs."""
    from backend.models.loader import load_model
    from tests.backend.tiny_checkpoints import make_tiny

    model = load_model(make_tiny("glm_moe_dsa", tmp_path / "dsa", index_topk=32), dtype=torch.float32)
    assert model.model.dense_context == 32
    plain, graphed = engines(model)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.widths == [2, graphs.max_pages] and graphs.max_pages > 2
    assert sorted(graphs._replays) == [(b, w) for b in BUCKETS for w in graphs.widths]
    widths: list[int] = []
    for key, replay in list(graphs._replays.items()):
        graphs._replays[key] = lambda key=key, replay=replay: widths.append(key[1]) or replay()
    # prompts of 5, 12, 19 and 26 tokens, 12 more each: the longest crosses 32 tokens mid-decode
    want = run_all(plain, batch_of(4, vocab_of(model)))
    got = run_checking_padding(graphed, batch_of(4, vocab_of(model)))
    assert set(widths) == set(graphs.widths), widths
    for rid, w in want.items():
        g = got[rid]
        assert (g.token_ids, g.finish_reason, g.error) == (w.token_ids, w.finish_reason, w.error), rid
        torch.testing.assert_close(
            [lp.logprob for lp in g.logprobs], [lp.logprob for lp in w.logprobs], atol=1e-4, rtol=1e-4
        )


def test_more_seqs_than_the_largest_bucket_run_eagerly() -> None:
    plain, graphed = engines(TinyPagedModel(), max_num_seqs=8, cuda_graph_batch_sizes=(1, 2, 4))
    want = run_all(plain, batch_of(6, 97))
    got = run_all(graphed, batch_of(6, 97))
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    assert graphed.runner.graphs is not None
    assert graphed.runner.graphs.bucket_for(5) is None and graphed.runner.graphs.bucket_for(3) == 4


class Recorder:
    """A forward that keeps a copy of every batch it is given (a stand-in model: logits = ids)."""

    def __init__(self, vocab: int = 11) -> None:
        self.vocab = vocab
        self.seen: list[dict[str, torch.Tensor]] = []

    def __call__(self, batch: ForwardBatch) -> torch.Tensor:
        fields = ("input_ids", "positions", "seq_lens", "slot_mapping", "page_table", "expected_tags")
        self.seen.append({f: getattr(batch, f).clone() for f in fields})
        return torch.nn.functional.one_hot(batch.input_ids % self.vocab, self.vocab).float()


def graphs_over(
    forward: Callable[[ForwardBatch], torch.Tensor], capture: Callable = eager_capture
) -> DecodeGraphs:
    kv = KVCache.allocate([[]], NUM_PAGES + 1, 4, dtype=torch.float32, model_dtype=torch.float32)
    kv.page_tags[:NUM_PAGES] = torch.arange(1, NUM_PAGES + 1)  # every real page allocated once
    return DecodeGraphs(forward, kv, batch_sizes=[4, 1, 2], max_pages=6, check_tags=True, capture=capture)


def host_batch(
    *,
    input_ids: list[int],
    positions: list[int],
    slots: list[int],
    seq_lens: list[int],
    page_ids: list[list[int]],
    expected_tags: list[list[int]],
) -> HostBatch:
    """A pure-decode HostBatch from lists, its page tables padded as the runner pads them."""
    B, width = len(seq_lens), max(len(p) for p in page_ids)
    table = np.zeros((B, width), dtype=np.int32)
    tags = np.full((B, width), -1, dtype=np.int64)
    for b, (p, t) in enumerate(zip(page_ids, expected_tags, strict=True)):
        table[b, : len(p)], tags[b, : len(t)] = p, t
    i64 = np.int64
    return HostBatch(
        input_ids=np.array(input_ids, dtype=i64),
        positions=np.array(positions, dtype=i64),
        slots=np.array(slots, dtype=i64),
        seq_index=np.arange(B),
        query_start=np.arange(B + 1, dtype=np.int32),
        seq_lens=np.array(seq_lens, dtype=np.int32),
        logits_indices=np.arange(B),
        page_table=table,
        expected_tags=tags,
        is_pure_decode=True,
    )


def test_padding_rows_point_at_the_scratch_page_only() -> None:
    rec = Recorder()
    graphs = graphs_over(rec)
    assert rec.seen == []  # eager_capture runs a step only when it is replayed
    host = host_batch(
        input_ids=[7, 8, 9],
        positions=[4, 0, 9],
        slots=[3 * 4 + 0, 5 * 4 + 0, 9 * 4 + 1],
        seq_lens=[5, 1, 10],
        page_ids=[[2, 3], [5], [8, 1, 9]],
        expected_tags=[[3, 4], [6], [9, 2, 10]],
    )
    logits, mismatch = graphs.run(host) or (None, None)
    assert logits is not None and mismatch is not None
    assert logits.argmax(-1).tolist() == [7, 8, 9] and mismatch.tolist() == [False] * 3
    (s,) = rec.seen  # bucket 4
    scratch = NUM_PAGES
    assert graphs.scratch_page == scratch and graphs.kv_cache.page_tags[scratch] == SCRATCH_TAG
    assert s["input_ids"].tolist() == [7, 8, 9, 0] and s["positions"].tolist() == [4, 0, 9, 0]
    assert s["seq_lens"].tolist() == [5, 1, 10, 1]
    assert s["slot_mapping"].tolist() == [12, 20, 37, scratch * 4]
    assert s["page_table"][:, :3].tolist() == [
        [2, 3, scratch],
        [5, scratch, scratch],
        [8, 1, 9],
        [scratch] * 3,
    ]
    assert s["expected_tags"][:, :3].tolist() == [
        [3, 4, PAST_TAG],
        [6, PAST_TAG, PAST_TAG],
        [9, 2, 10],
        [SCRATCH_TAG, PAST_TAG, PAST_TAG],  # a padding row expects the scratch page's tag in its one page
    ]
    assert (s["expected_tags"][:, 3:] == PAST_TAG).all()
    assert s["page_table"].shape == (4, 6)  # the buffers' width, whatever this step's widest sequence
    # a step whose widest sequence exceeds the buffers, or with too many sequences, runs eagerly
    wide = host_batch(
        input_ids=[1], positions=[29], slots=[0], seq_lens=[30], page_ids=[[0] * 7], expected_tags=[[1] * 7]
    )
    assert graphs.run(wide) is None
    many = host_batch(
        input_ids=[1] * 5,
        positions=[0] * 5,
        slots=[0] * 5,
        seq_lens=[1] * 5,
        page_ids=[[0]] * 5,
        expected_tags=[[1]] * 5,
    )
    assert graphs.run(many) is None


def test_columns_past_a_narrower_step_hold_the_scratch_page() -> None:
    """A wide step, then narrower ones in a smaller and a larger bucket: every column past a step's
    width holds the scratch page under PAST_TAG, never the wide step's real (page, tag) pairs (issue 27:
    a kernel reading past a row's pages must find nothing of another sequence's, and be flagged)."""
    rec = Recorder()
    graphs = graphs_over(rec)
    scratch = NUM_PAGES
    wide = host_batch(
        input_ids=[1, 2],
        positions=[19, 3],
        slots=[9 * 4 + 3, 2 * 4 + 3],
        seq_lens=[20, 4],
        page_ids=[[3, 4, 5, 6, 9], [2]],
        expected_tags=[[4, 5, 6, 7, 10], [3]],
    )
    one = host_batch(
        input_ids=[3], positions=[4], slots=[7 * 4], seq_lens=[5], page_ids=[[1, 7]], expected_tags=[[2, 8]]
    )
    three = host_batch(
        input_ids=[4, 5, 6],
        positions=[0, 1, 2],
        slots=[8 * 4, 8 * 4 + 1, 8 * 4 + 2],
        seq_lens=[1, 2, 3],
        page_ids=[[8], [8], [8]],
        expected_tags=[[9], [9], [9]],
    )
    for host in (wide, one, three):
        assert graphs.run(host) is not None
    s_wide, s_one, s_three = rec.seen
    assert s_wide["page_table"][0, :5].tolist() == [3, 4, 5, 6, 9]  # the wide step did write its pairs
    assert s_one["page_table"].tolist() == [[1, 7] + [scratch] * 4]
    assert s_one["expected_tags"].tolist() == [[2, 8] + [PAST_TAG] * 4]
    assert s_three["page_table"].tolist() == [[8] + [scratch] * 5] * 3 + [[scratch] * 6]
    assert s_three["expected_tags"].tolist() == [[9] + [PAST_TAG] * 5] * 3 + [[SCRATCH_TAG] + [PAST_TAG] * 5]


def test_a_row_read_past_its_pages_is_flagged_on_the_graph_path() -> None:
    """A row whose length runs past the pages it was given (a wrong reservation, which no planner
    makes) reads the scratch page there under PAST_TAG, which no page carries: its tag check flags that
    row alone, where SCRATCH_TAG in those columns would have let it read the scratch page unflagged."""
    graphs: DecodeGraphs

    def tag_check(batch: ForwardBatch) -> torch.Tensor:  # what every page-reading op does first
        check_tags_ref(
            graphs.kv_cache.page_tags,
            batch.page_table,
            batch.expected_tags,
            batch.seq_lens,
            4,
            batch.tag_mismatch,
        )
        return torch.zeros(batch.num_seqs, 5)

    graphs = graphs_over(tag_check)
    host = host_batch(
        input_ids=[1, 2, 3],
        positions=[6, 9, 2],
        slots=[4 * 4 + 2, 7 * 4 + 1, 8 * 4 + 2],
        seq_lens=[7, 10, 3],  # the second needs 3 pages, given 2 (the table is 2 wide)
        page_ids=[[3, 4], [6, 7], [8]],
        expected_tags=[[4, 5], [7, 8], [9]],
    )
    out = graphs.run(host)
    assert out is not None
    assert out[1].tolist() == [False, True, False]
    assert not graphs.tag_mismatch[3:].any()  # nor the padding row


def refuse(step: Callable[[], torch.Tensor]) -> Replay:
    raise RuntimeError("a host sync while capturing")


def test_a_capture_that_fails_leaves_every_step_eager(caplog: pytest.LogCaptureFixture) -> None:
    graphs = graphs_over(Recorder(), capture=refuse)
    assert not graphs.is_enabled and graphs.bucket_for(1) is None
    assert graphs.disabled_reason == "RuntimeError: a host sync while capturing"
    plain = make_engine(TinyPagedModel(), num_pages=NUM_PAGES, max_num_seqs=8)
    with caplog.at_level(logging.WARNING, logger="kumo.engine"):
        graphed = make_engine(TinyPagedModel(), num_pages=NUM_PAGES, max_num_seqs=8, graph_capture=refuse)
    assert "decode steps run eagerly, not from CUDA graphs: RuntimeError: a host sync" in caplog.text
    want, got = run_all(plain, batch_of(3, 97)), run_all(graphed, batch_of(3, 97))
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in want.items()}
    assert graphed.runner.graphs is not None and graphed.runner.graphs.num_replays == 0


def test_graph_switches() -> None:
    assert EngineConfig.build().cuda_graphs and EngineConfig.build(max_num_seqs=64).graph_batch_sizes() == [
        1, 2, 4, 8, 16, 32, 48, 64,
    ]  # fmt: skip
    assert EngineConfig.build(max_num_seqs=3).graph_batch_sizes() == [1, 2, 3]
    assert EngineConfig.build(max_num_seqs=8, cuda_graph_batch_sizes=(4, 1, 16)).graph_batch_sizes() == [1, 4]
    # the CPU never captures, whatever the switch says
    assert make_engine(TinyPagedModel(), cuda_graphs=True).runner.graphs is None
    argv = ["--model", "m", "--port", "1", "--secret", "s" * 8]
    assert build_settings(argv).cuda_graphs and not build_settings([*argv, "--no-cuda-graphs"]).cuda_graphs
    assert bench_parser().parse_args(["variant"]).cuda_graphs
    assert not bench_parser().parse_args(["variant", "--no-cuda-graphs"]).cuda_graphs
    assert not engine_config(8, 16, "bf16", 1, 64, cuda_graphs=False).cuda_graphs


@pytest.mark.parametrize("model_name", ["tiny", "deepseek_v3"])
def test_a_tag_fault_mid_decode_is_caught_on_the_graph_path(models: ModelShelf, model_name: str) -> None:
    model = models[model_name]
    plain, graphed = engines(model)
    clean = run_all(plain, batch_of(3, vocab_of(model)))
    injector = FaultInjector(graphed)
    results: dict[str, Result] = {}
    for req in batch_of(3, vocab_of(model)):
        graphed.add_request(req)
    while graphed.has_unfinished:
        if not injector.log and len(results.get("r1", Result()).token_ids) == 4:
            injector.reassign_live_page("r1", "r2")  # r1's first page now belongs to r2
            replays = graphed.runner.graphs.num_replays  # type: ignore[union-attr]
        collect(results, graphed.step())
    assert graphed.runner.graphs is not None and graphed.runner.graphs.num_replays > replays
    assert results["r1"].error is not None and results["r1"].error.code == "integrity_abort"
    assert results["r1"].finish_reason == "abort" and results["r1"].token_ids == clean["r1"].token_ids[:4]
    assert results["r0"].token_ids == clean["r0"].token_ids
    assert graphed.stats.tag_check_aborts == 1


def routed_tokens(
    model: torch.nn.Module, is_sharded: bool, seed: int
) -> tuple[Experts, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The model's first `Experts`, and 5 tokens routed 2 experts each (x, weights, ids); with
    `is_sharded`, ids >= E stand for another rank's experts."""
    experts = next(m for m in model.modules() if isinstance(m, Experts))
    E, H = experts.e1 - experts.e0, experts.gate_up_proj.shape[2]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(5, H, generator=g)
    ids = torch.tensor([[0, E - 2], [1, E - 1], [3, 2], [E - 1, 0], [2, 1]])
    if is_sharded:
        ids = torch.tensor([[0, E], [1, E - 1], [E + 1, E + 2], [E - 1, 0], [2, E]])  # >= E: another rank's
    return experts, x, torch.rand(5, 2, generator=g), ids


@pytest.mark.parametrize("is_sharded", [False, True])
def test_every_expert_path_equals_the_loop(models: ModelShelf, is_sharded: bool) -> None:
    """The fixed-shape path (captured decode steps) sums what the loop does. Holding every expert,
    every id is a column of its own; a rank holding some (`is_sharded`: ids >= E stand for another
    rank's) drops the others' through the extra column."""
    experts, x, weights, ids = routed_tokens(models["deepseek_v3"].model, is_sharded, seed=0)
    want = experts(x, weights, ids)
    with sync_free():
        got = experts(x, weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert want[0].abs().max() > 0 and (got[2].abs().max() == 0) == is_sharded


def test_captures_hold_the_collector_off_and_restore_it() -> None:
    """`no_collection` (around every CUDA graph capture): off inside, on again after, an exception
    included; left off where it was off (a caller's own `gc.disable`)."""
    import gc

    assert gc.isenabled()
    with no_collection():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), no_collection():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    gc.disable()
    try:
        with no_collection():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_a_runs_flags_survive_the_next_run() -> None:
    """A speculative step's chained draft depths replay the same graphs one after another and read
    every depth's flags after the last: a depth's flags must not be the buffer the next replay
    clears and rewrites (a flagged row was lost, or a later depth's flag blamed another sequence)."""

    def checking(batch: ForwardBatch) -> torch.Tensor:
        tags = batch.kv_cache.page_tags[batch.page_table[:, 0].long()]
        batch.tag_mismatch |= tags != batch.expected_tags[:, 0]
        return batch.positions.float()[:, None].expand(-1, 4).contiguous()

    graphs = graphs_over(checking)
    # depth 1: X reads page 3 under a stale tag, Y page 9 under its own (tags are page + 1)
    depth1 = host_batch(
        input_ids=[0, 0],
        positions=[5, 7],
        slots=[12, 36],
        seq_lens=[6, 8],
        page_ids=[[3], [9]],
        expected_tags=[[999], [10]],
    )
    depth2 = host_batch(
        input_ids=[0], positions=[8], slots=[36], seq_lens=[9], page_ids=[[9]], expected_tags=[[10]]
    )
    _, flags1 = graphs.run(depth1) or (None, None)
    _, flags2 = graphs.run(depth2) or (None, None)
    assert flags1 is not None and flags2 is not None
    assert flags1.tolist() == [True, False] and flags2.tolist() == [False]

"""Verify steps over the verify graphs' static buffers, and draft depths over the MTP layer's decode
graphs, on the CPU (backend/engine/speculative/verify_graphs.py, backend/engine/speculative/forwards.py).

`eager_capture` runs the static buffers and padding rows without a graph, so bucketing, padding and
the (k, bucket) choice are checked against the eager speculative engine: the same tokens, logprobs
and KV pages (padding rows touch only the scratch page). The capture itself is checked on the device
(test_speculative_cuda.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from backend.engine.decode_graphs import eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.forward_batch import HostBatch
from backend.engine.speculative.verify_graphs import VerifyGraphs
from backend.models.loader import load_model, prepare_model
from tests.backend.capture_probe import AddressCapture
from tests.backend.engine.test_draft_policy import ScriptedK
from tests.backend.engine.test_speculative import OracleDrafts, prompts
from tests.backend.engine_helpers import Result, collect, request, run_all
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

NUM_PAGES = 96
ARCHS = ("deepseek_v3", "glm_moe_dsa")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("verify")
    return {
        arch: load_model(add_mtp_layers(make_tiny(arch, root / arch)), dtype=torch.float32, num_mtp_layers=1)
        for arch in ARCHS
    }


def engine(model: Any, k: int, *, graphs: bool, **config: Any) -> Engine:
    values = dict(num_pages=NUM_PAGES, page_size=8, max_num_batched_tokens=64, max_num_seqs=8)
    values |= dict(num_speculative_tokens=k, speculative_max_seqs=8, speculative_adaptive=False)
    values |= dict(cuda_graph_batch_sizes=(1, 2, 4, 8), speculative_graphs=True) | config
    c = EngineConfig.build(**values)
    return Engine.from_prepared(prepare_model(model, c), c, graph_capture=eager_capture if graphs else None)


def run_checking_padding(e: Engine, reqs: list[Any]) -> dict[str, Result]:
    graphs = verify_graphs(e)
    results: dict[str, Result] = {}
    for r in reqs:
        e.add_request(r)
    while e.has_unfinished:
        collect(results, e.step())
        assert not graphs.tag_mismatch.any()  # no padding row (nor real one) was flagged
    return results


def verify_graphs(e: Engine) -> VerifyGraphs:
    forwards = e.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None
    return forwards.graphs


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("num_seqs", [1, 3, 8])
def test_verify_graph_path_equals_eager(tiny: dict[str, Any], arch: str, num_seqs: int) -> None:
    model = tiny[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=10 + 2 * i, logprobs=True, top_logprobs=2)
        for i, p in enumerate(prompts(num_seqs, model.config.vocab_size, seed=num_seqs))
    ]
    plain = run_all(engine(model, 0, graphs=False), reqs)
    eager, graphed = engine(model, 3, graphs=False), engine(model, 3, graphs=True)
    for e in (eager, graphed):
        OracleDrafts(e, plain, p_wrong=0.25)
    want = run_all(eager, reqs)
    got = run_checking_padding(graphed, reqs)
    graphs = verify_graphs(graphed)
    assert eager.runner.spec_forwards is not None and eager.runner.spec_forwards.graphs is None
    assert graphs.num_replays > 0
    forwards = graphed.runner.spec_forwards
    assert forwards is not None and len(forwards.draft_graphs) == 1  # draft depths 1, 2: the MTP layer's
    assert forwards.draft_graphs[0].num_replays > 0
    assert forwards.propose_graphs is not None and forwards.propose_graphs.num_replays > 0  # depth 0
    for rid, w in want.items():
        g = got[rid]
        assert g.token_ids == w.token_ids == plain[rid].token_ids, rid
        torch.testing.assert_close(
            [lp.logprob for lp in g.logprobs], [lp.logprob for lp in w.logprobs], atol=1e-5, rtol=1e-5
        )
    # padding rows wrote no real page: every page (the MTP layer's slot too) holds what the eager
    # speculative run wrote
    assert graphed.runner.kv_cache.num_pages == NUM_PAGES + 1
    for layer_e, layer_g in zip(eager.runner.kv_cache.layers, graphed.runner.kv_cache.layers, strict=True):
        for name, cache in layer_e.items():
            torch.testing.assert_close(layer_g[name][:NUM_PAGES], cache, atol=1e-5, rtol=1e-5)
    assert graphed.stats.tag_check_aborts == 0
    assert graphed.stats.spec_accepted_tokens == eager.stats.spec_accepted_tokens > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_every_draft_length_replays_its_own_graph(tiny: dict[str, Any], arch: str) -> None:
    """k changing per step (3, 3, 2, 2, 1, 1, 0, …): each k in 1 … 3 runs in its own graph, and
    outputs stay plain decoding's."""
    model = tiny[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=24) for i, p in enumerate(prompts(4, model.config.vocab_size, seed=8))
    ]
    plain = run_all(engine(model, 0, graphs=False), reqs)
    graphed = engine(model, 3, graphs=True)
    OracleDrafts(graphed, plain, p_wrong=0.2)
    ScriptedK(graphed, cycle=[3, 3, 2, 2, 1, 1, 0])
    graphs = verify_graphs(graphed)
    seen: list[tuple[int, int, int]] = []
    replay = graphs._replays.copy()
    for key, fn in replay.items():
        graphs._replays[key] = lambda key=key, fn=fn: (seen.append(key), fn())[1]
    greedy_seen: list[tuple[int, int, int]] = []  # greedy rows without logprobs: whole steps in one graph
    for key, fn in graphs._greedy_replays.copy().items():
        graphs._greedy_replays[key] = lambda key=key, fn=fn: (greedy_seen.append(key), fn())[1]
    got = run_checking_padding(graphed, reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert {k for k, _, _ in seen + greedy_seen} == {1, 2, 3}
    assert {k for k, _, _ in greedy_seen} == {1, 2, 3} and graphs.num_greedy_replays == len(greedy_seen)


def host(k: int, num_seqs: int, *, logits_rows: int | None = None, images: bool = False) -> HostBatch:
    T = num_seqs * (k + 1)
    return HostBatch(
        input_ids=np.zeros(T, dtype=np.int64),
        positions=np.arange(T, dtype=np.int64),
        slots=np.arange(T, dtype=np.int64),
        seq_index=np.arange(T) // (k + 1),
        query_start=(np.arange(num_seqs + 1) * (k + 1)).astype(np.int32),
        seq_lens=np.full(num_seqs, k + 1, dtype=np.int32),
        logits_indices=np.arange(T if logits_rows is None else logits_rows, dtype=np.int64),
        page_table=np.zeros((num_seqs, 1), dtype=np.int32),
        expected_tags=np.zeros((num_seqs, 1), dtype=np.int64),
        image_rows=[0] if images else [],
    )


def test_only_uniform_verify_steps_take_a_graph(tiny: dict[str, Any]) -> None:
    e = engine(tiny["deepseek_v3"], 3, graphs=True, page_size=4, num_pages=32)
    graphs = verify_graphs(e)
    assert graphs.draft_lengths == [1, 2, 3]  # k + 1 rows fit a page of 4
    width = graphs.max_pages  # no narrow graphs: DeepSeek-V3 reads every key at any length
    assert graphs.widths == [width]
    assert graphs.shape_of(host(3, 3)) == (3, 4, width) and graphs.shape_of(host(1, 8)) == (1, 8, width)
    assert graphs.shape_of(host(0, 2)) is None  # no drafts: a decode step (the decode graphs')
    assert graphs.shape_of(host(2, 9)) is None  # more sequences than the largest bucket
    assert graphs.shape_of(host(2, 2, logits_rows=5)) is None  # a prompt-logprobs row or a chunk
    assert graphs.shape_of(host(2, 2, images=True)) is None
    ragged = host(2, 2)
    ragged.query_start = np.array([0, 2, 6], dtype=np.int32)
    assert graphs.shape_of(ragged) is None  # sequences with different numbers of drafts
    small = engine(tiny["deepseek_v3"], 3, graphs=True, page_size=2, num_pages=64)
    assert verify_graphs(small).draft_lengths == [1]  # padding rows need k + 1 slots of one page


def test_mixed_steps_run_eagerly(tmp_path: Path, tiny: dict[str, Any]) -> None:
    """A verify beside a prefill chunk is not uniform: eager, and still exact."""
    model = tiny["deepseek_v3"]
    ps = prompts(6, model.config.vocab_size, seed=4)
    reqs = [request(f"r{i}", p * 3, max_tokens=12) for i, p in enumerate(ps)]  # long prompts, in chunks
    plain = run_all(engine(model, 0, graphs=False), reqs)
    graphed = engine(model, 2, graphs=True, max_num_batched_tokens=16)
    OracleDrafts(graphed, plain, p_wrong=0.2)
    graphs = verify_graphs(graphed)
    forward_spec = graphed.runner.model.forward_spec  # type: ignore[attr-defined]
    num_eager = 0

    def counting(batch: Any, step: Any = None) -> Any:
        nonlocal num_eager
        num_eager += batch.tag_mismatch.data_ptr() != graphs.tag_mismatch.data_ptr()
        return forward_spec(batch, step)

    graphed.runner.model.forward_spec = counting  # type: ignore[attr-defined]
    # the graph steps were captured over the original forward: rebuild them over the counting one
    graphed.runner.spec_forwards.graphs = VerifyGraphs(  # type: ignore[union-attr]
        counting,
        graphed.runner.kv_cache,
        max_drafts=2,
        batch_sizes=[1, 2, 4, 8],
        max_pages=graphs.max_pages,
        check_tags=True,
        capture=eager_capture,
    )
    try:
        got = run_all(graphed, reqs)
    finally:
        del graphed.runner.model.forward_spec  # type: ignore[attr-defined]  # the module's model
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert num_eager > 0 and verify_graphs(graphed).num_replays > 0


def test_capture_warm_up_runs_valid_padding_rows(tiny: dict[str, Any]) -> None:
    """A real capture runs each step once before recording it (CudaGraphCapture's warm-up): the
    buffers then hold padding sequences (positions 0 … k of the scratch page), which no check flags."""
    calls: list[tuple[int, int]] = []

    def warm_capture(step: Any) -> Any:
        logits, hidden = step()
        calls.append((int(logits.shape[0]), int(hidden.shape[0])))
        return step

    e = engine(tiny["glm_moe_dsa"], 3, graphs=True)
    graphs = VerifyGraphs(
        e.runner.model.forward_spec,  # type: ignore[attr-defined]
        e.runner.kv_cache,
        max_drafts=3,
        batch_sizes=[1, 2, 4],
        max_pages=8,
        check_tags=True,
        capture=warm_capture,
    )
    assert graphs.disabled_reason is None and len(calls) == 9
    assert sorted(calls) == sorted((b * (k + 1), b * (k + 1)) for k in (1, 2, 3) for b in (1, 2, 4))
    assert not graphs.tag_mismatch.any()
    assert graphs.seq_lens.tolist() == [2, 2, 2, 2]  # the last capture's (k = 1): last position + 1


@pytest.mark.parametrize("arch", ARCHS)
def test_captured_steps_read_only_tensors_that_outlive_them(tiny: dict[str, Any], arch: str) -> None:
    """A graph keeps the addresses its step read, not the step (tests/backend/capture_probe.py): every
    tensor a captured decode, verify or draft step reads from outside itself must live on without the
    step (the graphs' static buffers, the model's weights, the KV cache), or a replay reads memory the
    allocator has handed to another tensor since."""
    capture = AddressCapture()
    model = tiny[arch]
    c = EngineConfig.build(
        num_pages=NUM_PAGES, page_size=8, max_num_batched_tokens=64, max_num_seqs=8, num_speculative_tokens=3,
        speculative_max_seqs=8, cuda_graph_batch_sizes=(1, 2, 4, 8), speculative_graphs=True,
    )  # fmt: skip
    e = Engine.from_prepared(prepare_model(model, c), c, graph_capture=capture)
    graphs, forwards = verify_graphs(e), e.runner.spec_forwards
    assert forwards is not None and len(forwards.draft_graphs) == 1
    widths = len(graphs.widths)  # two for DSA (a narrow one: backend/engine/decode_graphs.py)
    assert graphs.disabled_reason is None and len(graphs._replays) == 3 * 4 * widths
    decode = e.runner.graphs
    assert decode is not None
    # decode (a second, narrow width for DSA models: backend/engine/decode_graphs.py), verify (k = 1 … 3),
    # depth 0 (k = 1 … 3), draft depths (over the draft graphs' own widths)
    draft_widths = sum(len(g.widths) for g in forwards.draft_graphs)
    # ... and the greedy and sampled steps (k = 1 … 3 each, over the verify's buffers)
    assert len(capture.steps) == 4 * len(decode.widths) + 4 * (3 * 4 * widths) + 4 * draft_widths
    proposals = forwards.propose_graphs
    assert proposals is not None
    # every kind of graph at the decode graphs' widths: a step takes the same path (dense at short
    # contexts, for DSA) whichever forward it is
    assert graphs.widths == proposals.widths == decode.widths
    assert all(g.widths == decode.widths for g in forwards.draft_graphs)
    assert len(decode.widths) == (2 if arch == "glm_moe_dsa" else 1)
    for buffer in (graphs.positions, graphs.page_table, graphs.seq_lens, graphs.draws, forwards._hidden_in):
        assert capture.read(buffer)  # the probe sees the static buffers the steps read
    for buffer in (proposals.positions, proposals.page_table, forwards._propose_hidden):
        assert capture.read(buffer)  # the probe sees the static buffers the steps read
    capture.release()
    freed = capture.freed()
    assert freed == [], "\n".join(freed)


class Ranks:
    """The tensor-parallel ranks' start-up vote (backend/engine/ranks.py `agree`): another rank's
    answer is `others`; the votes this rank cast are kept."""

    def __init__(self, others: bool) -> None:
        self.others, self.votes = others, []  # type: list[bool]

    def agree(self, is_ok: bool) -> bool:
        self.votes.append(is_ok)
        return is_ok and self.others


@pytest.mark.parametrize("others", [True, False])
def test_ranks_replay_verify_and_draft_graphs_together_or_not_at_all(
    tiny: dict[str, Any], others: bool
) -> None:
    """As with decode graphs: one rank replaying a captured verify (its collectives sized for the
    padded bucket) beside another running it eagerly would pair collectives of different sizes. Each
    kind of graph is voted on; a rank that captured drops its graphs when another did not."""
    from backend.engine.speculative.forwards import SpecForwards

    e = engine(tiny["deepseek_v3"], 3, graphs=True)
    ranks = Ranks(others)
    forwards = SpecForwards.build(
        e.runner.model, e.runner.kv_cache, e.config, capture=eager_capture, max_seq_len=None, ranks=ranks
    )
    # this rank captured its verify graphs, then (when every rank did) its greedy-step, sampled-step
    # and depth-0 graphs, and its draft graphs
    assert ranks.votes == ([True, True, True, True, True] if others else [True, True])
    assert forwards.graphs is not None and forwards.graphs.is_enabled == others
    assert forwards.graphs.has_greedy == others
    assert forwards.graphs.has_sampled == others
    assert (forwards.propose_graphs is not None) == others
    assert bool(forwards.draft_graphs) == others
    if not others:
        assert forwards.graphs.disabled_reason == "verify graphs failed to capture on another rank"
        reqs = [request(f"r{i}", p, max_tokens=8) for i, p in enumerate(prompts(2, 64, seed=5))]
        e.runner.spec_forwards = forwards  # the eager path serves every verify and draft step
        assert all(r.token_ids for r in run_all(e, reqs).values())


def test_dsa_whole_steps_within_index_topk_replay_the_narrow_graphs(tmp_path: Path) -> None:
    """GLM-5 with index_topk 32 (four pages of 8): the verify, whole-step and depth-0 graphs are
    captured at the decode graphs' two widths; greedy steps whose page tables (the chained drafts'
    pages included) fit 32 tokens replay the narrow graph (dense MLA, no indexer: the decode graphs'
    path at that length), longer ones the full width's, and outputs are plain decoding's."""
    model = load_model(
        add_mtp_layers(make_tiny("glm_moe_dsa", tmp_path / "dsa", index_topk=32)),
        dtype=torch.float32,
        num_mtp_layers=1,
    )
    graphed = engine(model, 3, graphs=True)
    forwards = graphed.runner.spec_forwards
    decode = graphed.runner.graphs
    assert forwards is not None and forwards.propose_graphs is not None and decode is not None
    graphs = verify_graphs(graphed)
    assert graphs.widths == decode.widths == forwards.propose_graphs.widths == [4, graphs.max_pages]
    assert sorted(graphs._greedy_replays) == [
        (k, b, w) for k in (1, 2, 3) for b in (1, 2, 4, 8) for w in graphs.widths
    ]
    widths: list[int] = []
    for key, fn in graphs._greedy_replays.copy().items():
        graphs._greedy_replays[key] = lambda key=key, fn=fn: (widths.append(key[2]), fn())[1]
    # a prompt of 10 tokens and 30 new ones: its table crosses 32 tokens mid-decode
    reqs = [request("r0", prompts(1, model.config.vocab_size, seed=3)[0][:10] * 2, max_tokens=30)]
    plain = run_all(engine(model, 0, graphs=False), reqs)
    OracleDrafts(graphed, plain, p_wrong=0.2)
    got = run_checking_padding(graphed, reqs)
    assert set(widths) == set(graphs.widths), widths
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}


@pytest.mark.parametrize("arch", ARCHS)
def test_padding_rows_chained_drafts_past_their_first_page_stay_unflagged(
    tiny: dict[str, Any], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole greedy step's padding sequence drafts on to position 2k − 1 when every draft is
    accepted: past its first page where 2k > S. Those columns expect the scratch page's own tag, so
    no padding row is flagged (past a real row's pages a column expects PAST_TAG: a read there is a
    fault), and the real rows are not either."""
    import backend.engine.speculative.greedy as greedy
    from kernels.verify_accept import VerifyAccept

    accept = greedy.verify_accept

    def accept_all(args: Any) -> VerifyAccept:  # every row takes all k drafts, padding rows too
        tail = accept(args)
        B, L = tail.targets.shape
        targets = tail.targets.clone()
        targets[:, : L - 1] = args.input_ids.view(B, L)[:, 1:]
        accepted = torch.full_like(tail.accepted, L - 1)
        return VerifyAccept(targets, accepted, args.query_start[:B].long() + accepted)

    monkeypatch.setattr(greedy, "verify_accept", accept_all)
    e = engine(tiny[arch], 3, graphs=True, page_size=4)
    graphs = verify_graphs(e)
    assert graphs.pad_cols == 2  # positions 0 … 5 on pages of 4
    vocab = tiny[arch].config.vocab_size
    reqs = [request(f"r{i}", prompt, max_tokens=16) for i, prompt in enumerate(prompts(3, vocab, 11))]
    run_checking_padding(e, reqs)  # three sequences in the bucket of 4: one padding row a step
    assert graphs.num_greedy_replays > 0

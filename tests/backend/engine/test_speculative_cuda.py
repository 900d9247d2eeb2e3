"""Speculative decoding on a CUDA device: plain steps and uniform verify steps replay CUDA graphs,
other speculative forwards run eagerly, and greedy outputs stay those of an engine without
speculation (run through the device tool; skipped on the CPU)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.model_runner import SeqResult
from backend.engine.speculative.accept import banned_rows
from backend.engine.speculative.plan import SpecRow
from backend.models.loader import load_model, prepare_model
from schemas.backend import ReasoningMarkers
from tests.backend.engine.test_speculative import OracleDrafts, assert_same_or_tied, prompts
from tests.backend.engine_helpers import request, run_all
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

pytestmark = pytest.mark.gpu


def _engine(model: Any, k: int) -> Engine:
    config = EngineConfig.build(
        num_pages=256, page_size=16, max_num_batched_tokens=256, max_num_seqs=32, num_speculative_tokens=k,
        speculative_draft_cost=0.25,  # drafting as the cost model says, not as step times do
    )  # fmt: skip
    return Engine.from_prepared(prepare_model(model, config), config)


def _fixed_k3(model: Any, **options: Any) -> Engine:
    """An engine that always drafts 3 tokens (no adaptive policy), `options` beside."""
    config = EngineConfig.build(
        num_pages=256, page_size=16, max_num_batched_tokens=256, max_num_seqs=32,
        num_speculative_tokens=3, speculative_adaptive=False, **options,
    )  # fmt: skip
    return Engine.from_prepared(prepare_model(model, config), config)


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_greedy_identical_on_cuda(tmp_path: Path, arch: str) -> None:
    """fp32: the verify rows run the prefill-shaped kernels, plain decodes the decode kernels (from
    CUDA graphs); only a near-tie (1e-5) may then pick the other token."""
    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    model = load_model(path, dtype=torch.float32, device="cuda", num_mtp_layers=1)
    reqs = [
        request(f"r{i}", p, max_tokens=4 + i % 29, logprobs=True, top_logprobs=2)
        for i, p in enumerate(prompts(64, model.config.vocab_size, seed=3))
    ]
    plain = run_all(_engine(model, 0), reqs)
    engine = _engine(model, 3)
    OracleDrafts(engine, plain, p_wrong=0.3)
    spec = run_all(engine, reqs)
    ties = sum(assert_same_or_tied(spec[r.request_id], plain[r.request_id], r.request_id) for r in reqs)
    assert ties <= 2
    assert engine.stats.spec_accepted_tokens > 0 and engine.stats.tag_check_aborts == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_verify_steps_replay_cuda_graphs(tmp_path: Path, arch: str) -> None:
    """Uniform verify steps (every sequence verifying k drafts) replay the captured (k, bucket)
    graphs on the device, draft depths 1 … K−1 the MTP layer's decode graphs: real replays counted, greedy outputs those of plain decoding (near-ties
    aside), the draft lengths the policy may pick all captured."""
    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    model = load_model(path, dtype=torch.float32, device="cuda", num_mtp_layers=1)
    reqs = [
        request(f"r{i}", p, max_tokens=24, logprobs=True, top_logprobs=2)
        for i, p in enumerate(prompts(6, model.config.vocab_size, seed=12))
    ]
    plain = run_all(_engine(model, 0), reqs)
    engine = _fixed_k3(model, speculative_graphs=True)
    forwards = engine.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None
    graphs = forwards.graphs
    assert graphs.is_enabled, graphs.disabled_reason
    # keyed (k, bucket, page-table width) at the decode graphs' widths: here only the full one (128
    # tokens, 8 pages), the tiny DSA's index_topk (8) being under a page (a narrow graph: a DSA model's
    # pages within index_topk, backend/engine/speculative/verify_graphs.py; test_verify_graphs.py)
    decode = engine.runner.graphs
    assert decode is not None and graphs.widths == decode.widths == [graphs.max_pages] == [8]
    assert sorted(graphs._replays) == [(k, b, 8) for k in (1, 2, 3) for b in (1, 2, 4, 8, 16)]
    OracleDrafts(engine, plain, p_wrong=0.3)
    spec = run_all(engine, reqs)
    assert graphs.num_replays >= 6  # the steps after the prompts, until requests near max_tokens
    assert forwards.draft_graphs and forwards.draft_graphs[0].num_replays > 0  # draft depths 1 and 2
    assert forwards.propose_graphs is not None and forwards.propose_graphs.num_replays > 0  # depth 0
    ties = sum(assert_same_or_tied(spec[r.request_id], plain[r.request_id], r.request_id) for r in reqs)
    assert ties <= 1
    assert engine.stats.spec_accepted_tokens > 0 and engine.stats.tag_check_aborts == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_greedy_steps_replay_one_graph_each(tmp_path: Path, arch: str) -> None:
    """Greedy rows without logprobs: each uniform speculative step is one captured graph (verify,
    acceptance, depth 0 and the chained drafts) and one read back; outputs plain decoding's (fp32,
    near-ties aside), and the pool as it was."""
    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    model = load_model(path, dtype=torch.float32, device="cuda", num_mtp_layers=1)
    reqs = [
        request(f"r{i}", p, max_tokens=32 + i)
        for i, p in enumerate(prompts(6, model.config.vocab_size, seed=13))
    ]
    plain = run_all(_engine(model, 0), reqs)
    engine = _fixed_k3(model)
    forwards = engine.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None
    assert forwards.graphs.has_greedy, forwards.graphs.greedy_disabled_reason
    OracleDrafts(engine, plain, p_wrong=0.3)
    spec = run_all(engine, reqs)
    assert engine.spec is not None and engine.spec.num_greedy_steps > 5
    assert forwards.graphs.num_greedy_replays == engine.spec.num_greedy_steps
    ties = sum(assert_same_or_tied(spec[r.request_id], plain[r.request_id], r.request_id) for r in reqs)
    assert ties <= 1
    assert engine.stats.spec_accepted_tokens > 0 and engine.stats.tag_check_aborts == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_guarded_greedy_steps_replay_their_graphs(tmp_path: Path, arch: str) -> None:
    """Requests inside an open reasoning block (issue 26's guard): each one's eos is the token its
    free run emits third, so the guard takes it away, and its end marker one its never-closed run
    emits later, so blocks close inside verify steps. The whole greedy steps still replay their
    graphs, each sequence's guard row staged with the step's inputs, and the tokens are plain
    decoding's with the guard on (fp32, near-ties aside)."""
    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    model = load_model(path, dtype=torch.float32, device="cuda", num_mtp_layers=1)
    V = model.config.vocab_size
    free = [request(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts(6, V, seed=14))]
    free_out = run_all(_engine(model, 0), free)

    def guarded(end_of: dict[str, int], **sampling: Any) -> list[Any]:
        return [
            msgspec.structs.replace(
                r,
                sampling=msgspec.structs.replace(r.sampling, **sampling),
                eos_token_ids=[free_out[r.request_id].token_ids[2]],
                reasoning_markers=ReasoningMarkers(start_id=V - 1, end_id=end_of[r.request_id], is_open=True),
            )
            for r in free
        ]

    never_closed = run_all(_engine(model, 0), guarded({r.request_id: -1 for r in free}))
    end_of = {rid: r.token_ids[24] for rid, r in never_closed.items()}
    plain = run_all(_engine(model, 0), guarded(end_of, logprobs=True, top_logprobs=2))
    assert sum(plain[rid].token_ids[:3] != free_out[rid].token_ids[:3] for rid in plain) >= 4  # it bites
    engine = _fixed_k3(model)
    forwards = engine.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None and engine.spec is not None
    assert forwards.graphs.has_greedy, forwards.graphs.greedy_disabled_reason
    spec = engine.spec
    run_greedy, num_banning = spec._run_greedy, [0]

    def counting(rows: list[SpecRow], tag_updates: list[tuple[int, int]]) -> list[SeqResult]:
        num_banning[0] += any(ids for r in rows for ids in banned_rows(r))
        return run_greedy(rows, tag_updates)

    spec._run_greedy = counting  # type: ignore[method-assign]
    OracleDrafts(engine, plain, p_wrong=0.3)
    got = run_all(engine, guarded(end_of))
    assert num_banning[0] > 5 and forwards.graphs.num_greedy_replays == spec.num_greedy_steps
    ties = sum(assert_same_or_tied(got[rid], plain[rid], rid) for rid in plain)
    assert ties <= 1
    assert engine.stats.tag_check_aborts == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_sampled_steps_replay_one_graph_each(tmp_path: Path, arch: str) -> None:
    """Sampled rows (temperature, top-k, top-p, no penalties, no logprobs): each uniform
    speculative step is one replay of the sampled whole-step graph (backend/engine/speculative/
    sampled.py) with one read back; seeded requests repeat their tokens on a second engine."""
    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    model = load_model(path, dtype=torch.float32, device="cuda", num_mtp_layers=1)
    reqs = [
        request(f"r{i}", p, max_tokens=32 + i, temperature=0.8, top_k=20, top_p=0.95, seed=i)
        for i, p in enumerate(prompts(6, model.config.vocab_size, seed=14))
    ]
    outputs = []
    for _ in range(2):
        engine = _fixed_k3(model, speculative_graphs=True)
        forwards = engine.runner.spec_forwards
        assert forwards is not None and forwards.graphs is not None and engine.spec is not None
        graphs = forwards.graphs
        assert graphs.has_sampled, graphs.sampled_disabled_reason
        out = run_all(engine, reqs)
        assert engine.spec.num_sampled_steps > 0
        assert graphs.num_greedy_replays == engine.spec.num_greedy_steps  # every whole step replayed
        assert all(out[f"r{i}"].error is None and len(out[f"r{i}"].token_ids) == 32 + i for i in range(6))
        outputs.append({rid: r.token_ids for rid, r in out.items()})
        bm = engine.block_manager
        assert bm.num_available_pages == bm.num_pages
    assert outputs[0] == outputs[1]  # the uniforms come from each request's seed

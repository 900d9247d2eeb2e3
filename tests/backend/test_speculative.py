"""Speculative decoding with MTP drafts (backend/speculative.py): exact outputs, pages, tags.

Greedy outputs with speculation must equal those without, token for token, on tiny random
checkpoints given random MTP layers (few drafts are accepted: exactness must not depend on them).
A Markov toy (tests/backend/speculative_toy.py) gives a head whose drafts are the target's own
tokens (every draft accepted) and a known distribution for the χ² test of sampled outputs.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch

from backend.engine import Engine
from backend.engine_config import EngineConfig
from backend.loader import load_model
from backend.speculative import parse_speculative
from tests.backend.engine_helpers import Result, collect, request, run_all
from tests.backend.speculative_toy import MarkovModel
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

ARCHS = ("deepseek_v3", "glm_moe_dsa")


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("mtp")
    return {
        arch: load_model(add_mtp_layers(make_tiny(arch, root / arch)), dtype=torch.float32, num_mtp_layers=1)
        for arch in ARCHS
    }


def engine_for(model: Any, k: int, **config: Any) -> Engine:
    values = dict(num_pages=96, page_size=8, max_num_batched_tokens=64, max_num_seqs=16)
    values |= dict(num_speculative_tokens=k, speculative_max_seqs=16) | config
    return Engine.from_loaded(model, EngineConfig.build(**values))


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (length,), generator=g).tolist() for length in lengths]


def check_pool(engine: Engine) -> None:
    """Every running sequence holds exactly the pages of its tokens, each under its current tag,
    and the cache's tags are the allocator's."""
    bm = engine.block_manager
    for seq in engine.scheduler.running:
        assert len(seq.page_table) == bm.num_pages_for(seq.num_tokens)
        assert [(r.page_id, r.tag) for r in seq.page_table] == [(r.page_id, r.tag) for r in bm._ledger[seq.request_id]]
        assert all(bm.tags[r.page_id] == r.tag for r in seq.page_table)
    assert engine.runner.kv_cache.page_tags.tolist() == bm.tags


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_identical(loaded: dict[str, Any], arch: str, k: int) -> None:
    model = loaded[arch]
    ps = prompts(24, model.config.vocab_size, seed=k)
    reqs = [request(f"r{i}", p, max_tokens=1 + i % 13) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, k)
    for r in reqs:
        engine.add_request(r)
    spec: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(spec, engine.step())
        check_pool(engine)
    for r in reqs:
        assert spec[r.request_id].error is None
        assert spec[r.request_id].token_ids == plain[r.request_id].token_ids, r.request_id
    s = engine.stats
    assert s.spec_drafted_tokens > 0 and s.tag_check_aborts == 0
    assert engine.block_manager.num_quarantined_pages == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


class OracleDrafts:
    """Replaces the MTP's drafts after each step with the plain run's next tokens, each wrong with
    probability `p_wrong`: verify then accepts runs of every length, on the real model."""

    def __init__(self, engine: Engine, plain: dict[str, Result], p_wrong: float, seed: int = 0) -> None:
        spec = engine.spec
        assert spec is not None
        self.rng = torch.Generator().manual_seed(seed)
        propose = spec._propose

        def oracle_propose(*args: Any) -> None:
            propose(*args)
            for rid, (num_tokens, drafts) in list(spec._drafts.items()):
                seq = engine._seqs[rid]
                at = num_tokens - seq.num_prompt_tokens  # output index of the first draft
                truth = plain[rid].token_ids[at : at + len(drafts)]
                wrong = torch.rand(len(truth), generator=self.rng) < p_wrong
                spec._drafts[rid] = (
                    num_tokens,
                    [(t + 1) % 256 if w else t for t, w in zip(truth, wrong.tolist(), strict=True)],
                )

        spec._propose = oracle_propose  # type: ignore[method-assign]


@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_identical_when_drafts_are_often_right(loaded: dict[str, Any], arch: str) -> None:
    model = loaded[arch]
    ps = prompts(16, model.config.vocab_size, seed=7)
    reqs = [
        request(f"r{i}", p, max_tokens=4 + i % 19, logprobs=True, top_logprobs=2) for i, p in enumerate(ps)
    ]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3)
    OracleDrafts(engine, plain, p_wrong=0.25)
    for r in reqs:
        engine.add_request(r)
    spec: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(spec, engine.step())
        check_pool(engine)
    for r in reqs:
        got, want = spec[r.request_id], plain[r.request_id]
        assert got.token_ids == want.token_ids, r.request_id
        assert got.finish_reason == want.finish_reason
        assert [lp.token_id for lp in got.logprobs] == got.token_ids
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
            assert [t.token_id for t in a.top] == [t.token_id for t in b.top]
            assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4)
        assert spec[r.request_id].outputs[-1].num_output_tokens == len(want.token_ids)
    s = engine.stats
    assert s.spec_accepted_tokens > s.spec_drafted_tokens / 3  # the accept path ran, at every length
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages

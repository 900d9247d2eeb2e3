"""The real models through the real engine (scheduler, block manager, model runner) vs transformers.

A 16-token step budget forces chunked prefill interleaved with other sequences' decodes; greedy
tokens for 32 steps must equal transformers' greedy tokens (computed without any cache).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.models.loader import load_model
from tests.backend.conformance import prompts, reference_greedy
from tests.backend.engine_helpers import request, run_all
from tests.backend.tiny_checkpoints import load_reference, make_tiny

NUM_STEPS = 32


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa", "glm4_moe"])
def test_engine_greedy_matches_transformers(arch: str, tmp_path: Path) -> None:
    path = make_tiny(arch, tmp_path / arch)
    loaded = load_model(path, dtype=torch.float32)
    engine = Engine(
        loaded.model,  # type: ignore[arg-type]
        EngineConfig.build(num_pages=32, page_size=16, max_num_batched_tokens=16, max_num_seqs=4),
        vocab_size=loaded.config.vocab_size,
        context_window=loaded.config.max_position_embeddings,
        model_dtype=torch.float32,
    )
    ps = prompts(loaded.config.vocab_size, (17, 33, 15))
    results = run_all(engine, [request(f"r{i}", p, max_tokens=NUM_STEPS) for i, p in enumerate(ps)])
    ref = load_reference(arch, path)
    for i, p in enumerate(ps):
        r = results[f"r{i}"]
        assert r.error is None
        assert r.token_ids == reference_greedy(ref, p, NUM_STEPS)
    assert engine.stats.tag_check_aborts == 0

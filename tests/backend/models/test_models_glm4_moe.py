"""GLM-4.5 (GQA + qkv bias + QK-norm + partial NeoX RoPE + MoE) on the paged cache vs transformers."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.models.loader import load_model
from tests.backend.conformance import MAX_ABS_DIFF, greedy_matches, prefill_max_diff
from tests.backend.tiny_checkpoints import make_tiny


@pytest.fixture(scope="module")
def glm4_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("glm4_moe", tmp_path_factory.mktemp("glm4") / "ckpt")


@pytest.mark.parametrize("chunk", [16, 7])
def test_glm4_moe_prefill_logits_match_transformers(glm4_path: Path, chunk: int) -> None:
    diff = prefill_max_diff("glm4_moe", glm4_path, chunk=chunk)
    print(f"glm4_moe chunk={chunk} max abs diff {diff:.2e}")
    assert diff <= MAX_ABS_DIFF


def test_glm4_moe_greedy_32_steps_match_transformers(glm4_path: Path) -> None:
    ours, theirs = greedy_matches("glm4_moe", glm4_path)
    assert ours == theirs


def test_glm4_moe_without_qk_norm_or_bias(tmp_path: Path) -> None:
    path = make_tiny("glm4_moe", tmp_path / "air", use_qk_norm=False, attention_bias=False, seed=3)
    assert prefill_max_diff("glm4_moe", path) <= MAX_ABS_DIFF


def test_gqa_cache_holds_k_and_v_per_kv_head(glm4_path: Path) -> None:
    loaded = load_model(glm4_path, dtype=torch.float32)
    c = loaded.config
    assert loaded.config.rope.dim == c.head_dim // 2 and not loaded.config.rope.is_interleaved
    for layer in loaded.model.cache_specs():
        assert [(s.name, s.shape) for s in layer] == [("k", (2, c.head_dim)), ("v", (2, c.head_dim))]

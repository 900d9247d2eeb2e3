"""Kimi K2.5 / K2.6 nested checkpoint: `text_config`, `language_model.` prefix, vision tower beside it."""

from __future__ import annotations

from pathlib import Path

import pytest

from backend.models.model_config import ModelConfig
from tests.backend.conformance import MAX_ABS_DIFF, greedy_matches, prefill_max_diff
from tests.backend.tiny_checkpoints import EOS_IDS, make_tiny


@pytest.fixture(scope="module")
def k25_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("kimi_k25", tmp_path_factory.mktemp("k25") / "ckpt")


def test_k25_config_reads_the_nested_text_model(k25_path: Path) -> None:
    c = ModelConfig.from_pretrained(k25_path)
    assert c.architecture == "KimiK25ForConditionalGeneration" and c.model_type == "kimi_k2"
    assert c.weight_prefix == "language_model."
    assert c.eos_token_ids == tuple(EOS_IDS)
    assert c.rope.rope_type == "yarn" and c.rope.theta == 50000.0


def test_k25_text_model_matches_transformers(k25_path: Path) -> None:
    diff = prefill_max_diff("kimi_k25", k25_path, chunk=16)
    print(f"kimi_k25 max abs diff {diff:.2e}")
    assert diff <= MAX_ABS_DIFF
    ours, theirs = greedy_matches("kimi_k25", k25_path)
    assert ours == theirs


def test_k25_as_transformers_writes_it_back_matches(tmp_path: Path) -> None:
    path = make_tiny("kimi_k25", tmp_path / "raw", as_published=False)  # `...model.blocks.N`, Kimi_K25 name
    assert ModelConfig.from_pretrained(path).architecture == "Kimi_K25ForConditionalGeneration"
    assert prefill_max_diff("kimi_k25", path, chunk=16) <= MAX_ABS_DIFF

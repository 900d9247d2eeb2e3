"""GLM-5 (MLA + DeepSeek Sparse Attention + MoE) on the paged cache vs transformers, float32.

`index_topk` (8) is smaller than most contexts here (up to 45 + 32 tokens), so the indexer's choice
decides the output; layer 1 reuses layer 0's choice ("shared"), layer 2 runs its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.models.loader import load_model
from tests.backend.conformance import MAX_ABS_DIFF, greedy_matches, prefill_max_diff, prompts
from tests.backend.paged_driver import PagedDriver
from tests.backend.tiny_checkpoints import make_tiny


@pytest.fixture(scope="module")
def dsa_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny("glm_moe_dsa", tmp_path_factory.mktemp("dsa") / "ckpt")


@pytest.mark.parametrize("chunk", [16, 7])
def test_glm_moe_dsa_prefill_logits_match_transformers(dsa_path: Path, chunk: int) -> None:
    diff = prefill_max_diff("glm_moe_dsa", dsa_path, chunk=chunk)
    print(f"glm_moe_dsa chunk={chunk} max abs diff {diff:.2e}")
    assert diff <= MAX_ABS_DIFF


def test_glm_moe_dsa_greedy_32_steps_match_transformers(dsa_path: Path) -> None:
    ours, theirs = greedy_matches("glm_moe_dsa", dsa_path)
    assert ours == theirs


def test_selection_matters(dsa_path: Path, tmp_path: Path) -> None:
    """With index_topk ≥ every context the model is dense MLA; the sparse logits must differ from that."""
    dense = make_tiny("glm_moe_dsa", tmp_path / "dense", index_topk=256)
    a, b = load_model(dsa_path, dtype=torch.float32), load_model(dense, dtype=torch.float32)
    ps = prompts(a.config.vocab_size, (45,))
    _, sparse_logits = PagedDriver(a.model).prefill(ps, 16)
    _, dense_logits = PagedDriver(b.model).prefill(ps, 16)
    # the first index_topk positions see their whole context either way; later ones must not
    assert torch.allclose(sparse_logits[0][:8], dense_logits[0][:8], atol=1e-5)
    assert float((sparse_logits[0][8:] - dense_logits[0][8:]).abs().max()) > 1e-2


def test_indexer_keys_are_cached_only_by_full_layers(dsa_path: Path) -> None:
    loaded = load_model(dsa_path, dtype=torch.float32)
    names = [[s.name for s in layer] for layer in loaded.model.cache_specs()]
    assert names == [["latent", "index_k"], ["latent"], ["latent", "index_k"]]

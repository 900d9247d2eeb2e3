"""GLM-5 (MLA + DeepSeek Sparse Attention + MoE) on the paged cache vs transformers, float32.

`index_topk` (8) is smaller than most contexts here (up to 45 + 32 tokens), so the indexer's choice
decides the output; layer 1 reuses layer 0's choice ("shared"), layer 2 runs its own.

Ties: a key every indexer head's ReLU zeroes scores exactly 0, and transformers as released takes
`torch.topk` over the query's row (its keys, then every later token masked), whose pick among equal
scores changes with the row's length. So its full forward is not causal: a token's output changes
when tokens are appended after it, and no cached decode can follow it. Kumo, and the reference the
tests use (`tiny_checkpoints.earlier_on_ties`), give equal scores to the earlier token.
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


def test_transformers_indexer_as_released_picks_among_ties_by_the_row_length() -> None:
    """By hand: every key is −e8 (wk = 0, the LayerNorm bias), both heads' q = +e8 (in the pass dims,
    untouched by RoPE), head weights 1: every q·k is −1, so every score is 0. Query 11 sees the same 12
    keys whatever follows it; as released its top 4 changes when masked tokens are appended."""
    import transformers as tf
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

    from tests.backend.tiny_checkpoints import config_dict, earlier_on_ties

    config = tf.GlmMoeDsaConfig(
        **config_dict("glm_moe_dsa", index_topk=4, index_n_heads=2, index_head_dim=16)
    )
    indexer = GlmMoeDsaIndexer(config, 0).eval()
    with torch.no_grad():
        indexer.wk.weight.zero_()
        indexer.k_norm.weight.fill_(1.0)
        indexer.k_norm.bias.zero_()
        indexer.k_norm.bias[8] = -1.0
        indexer.wq_b.weight.zero_()
        indexer.wq_b.weight[[8, 16 + 8], 0] = 1.0
        indexer.weights_proj.weight.zero_()
        indexer.weights_proj.weight[:, 0] = 1.0

    def query_11(n: int) -> list[int]:
        x, q_resid = torch.eye(64)[0].repeat(1, n, 1), torch.eye(48)[0].repeat(1, n, 1)
        cos_sin = (torch.ones(1, n, 8), torch.zeros(1, n, 8))
        causal = torch.full((n, n), torch.finfo(torch.float32).min).triu(1)[None]
        return indexer(x, q_resid, cos_sin, causal, None)[0, 11].tolist()

    as_released = {n: frozenset(query_11(n)) for n in (12, 13, 40)}
    assert len(set(as_released.values())) > 1, as_released
    earlier_on_ties(indexer)
    assert [query_11(n) for n in (12, 13, 40)] == [[0, 1, 2, 3]] * 3


def test_transformers_as_released_is_not_causal_and_the_test_reference_is(tmp_path: Path) -> None:
    """Two indexer heads (the issue's checkpoint): logits of the first n tokens, alone and followed by
    the rest of a 40-token sequence."""
    from tests.backend.conformance import reference_logits
    from tests.backend.tiny_checkpoints import load_reference

    path = make_tiny("glm_moe_dsa", tmp_path / "ckpt", index_topk=6, index_n_heads=2, index_head_dim=16)
    (tokens,) = prompts(256, (40,), seed=3)
    for as_released, worst_ok in ((True, False), (False, True)):
        ref = load_reference("glm_moe_dsa", path, as_released=as_released)
        full = reference_logits(ref, tokens)
        worst = max(
            float((reference_logits(ref, tokens[:n]) - full[:n]).abs().max()) for n in range(8, 40, 4)
        )
        assert (worst <= 1e-5) == worst_ok, (as_released, worst)

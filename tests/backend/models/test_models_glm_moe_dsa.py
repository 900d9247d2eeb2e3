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


def spied_indexer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Record the page-table width (in tokens) of every step whose indexer scores its keys."""
    import backend.models.glm_moe_dsa as dsa

    widths: list[int] = []
    real = dsa.dsa_indexer

    def scoring(args: dsa.DsaIndexerArgs) -> torch.Tensor:
        widths.append(int(args.batch.page_table.shape[1]))
        return real(args)

    monkeypatch.setattr(dsa, "dsa_indexer", scoring)
    return widths


def short_and_long(path: Path) -> tuple[list[torch.Tensor], list[list[int]]]:
    """Page size 4, index_topk 8: a 5- and a 29-token prompt prefilled together in chunks of 3 (steps
    of short sequences only, then mixed ones), then 6 greedy decode steps; (prefill logits, tokens)."""
    loaded = load_model(path, dtype=torch.float32)
    ps = prompts(loaded.config.vocab_size, (5, 29), seed=4)
    driver = PagedDriver(loaded.model, page_size=4)
    _, logits = driver.prefill(ps, 3)
    assert not driver.last_mismatch.any()
    return logits, PagedDriver(loaded.model, page_size=4).greedy(ps, 6, 3)


def test_steps_within_index_topk_skip_the_indexer_and_match_transformers(
    dsa_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Steps whose page table spans at most index_topk (8) tokens score nothing (two full layers:
    two indexer calls a scored step) and attend densely; later steps choose among keys the skipped
    steps cached. Every position matches the transformers reference, which selects at every step."""
    from tests.backend.conformance import reference_greedy, reference_logits
    from tests.backend.tiny_checkpoints import load_reference

    widths = spied_indexer(monkeypatch)
    logits, tokens = short_and_long(dsa_path)
    ref = load_reference("glm_moe_dsa", dsa_path)
    ps = prompts(256, (5, 29), seed=4)
    assert ref.config.vocab_size == 256
    for ours, p in zip(logits, ps, strict=True):
        assert float((ours - reference_logits(ref, p)).abs().max()) <= MAX_ABS_DIFF
    assert tokens == [reference_greedy(ref, p, 6) for p in ps]
    # each prefill: 10 steps (the longest sequence 3, 6, 9, ..., 27, 29 tokens), the first two dense;
    # then 5 decode steps over 30-34 tokens; two full layers score a step (the shared one reuses)
    assert min(widths) == 3 and len(widths) == 2 * (8 + 8 + 5), widths


def test_the_dense_path_equals_selecting_every_key(dsa_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (torch references) attending every key densely is the sparse path bit for bit: the
    same model with every step forced through the indexer (as before the skip) gives equal logits."""
    from backend.models.layers import step as step_module

    dense_logits, dense_tokens = short_and_long(dsa_path)
    build = step_module.Step.build.__func__  # type: ignore[attr-defined]

    def always_selecting(cls: type, *args: object, **kwargs: object) -> step_module.Step:
        s = build(cls, *args, **kwargs)
        s.table_tokens = 1 << 30  # as wide as no sequence: the indexer always runs
        return s

    monkeypatch.setattr(step_module.Step, "build", classmethod(always_selecting))
    widths = spied_indexer(monkeypatch)
    sparse_logits, sparse_tokens = short_and_long(dsa_path)
    assert min(widths) == 1  # the first chunk was scored this time
    assert sparse_tokens == dense_tokens
    for a, b in zip(dense_logits, sparse_logits, strict=True):
        assert torch.equal(a, b)


def test_a_shared_layer_with_no_full_layer_before_it_is_refused(dsa_path: Path) -> None:
    """Checked when the model is built: a step that skips the indexer leaves no choice to check."""
    import dataclasses

    from backend.errors import CheckpointError
    from backend.models.glm_moe_dsa import GlmMoeDsaForCausalLM

    config = load_model(dsa_path, dtype=torch.float32).config
    bad = dataclasses.replace(config, indexer_types=("shared", "full", "full"))
    with pytest.raises(CheckpointError, match="layer 0 shares top-k"):
        GlmMoeDsaForCausalLM(bad, dtype=torch.float32)
    GlmMoeDsaForCausalLM(
        dataclasses.replace(config, indexer_types=("full", "shared", "shared")), dtype=torch.float32
    )

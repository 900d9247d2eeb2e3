"""Page tags through the real models: a sequence whose page was reallocated under it is flagged,
reads nothing from that page, writes nothing into it, and no other sequence's logits change."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.models.loader import load_model
from tests.backend.conformance import prompts
from tests.backend.paged_driver import PagedDriver
from tests.backend.tiny_checkpoints import make_tiny


def _prefilled(path: Path) -> tuple[PagedDriver, list]:  # type: ignore[type-arg]
    loaded = load_model(path, dtype=torch.float32)
    driver = PagedDriver(loaded.model)
    seqs, logits = driver.prefill(prompts(loaded.config.vocab_size, (33, 20)), 16)
    for s, lg in zip(seqs, logits, strict=True):
        s.tokens.append(int(lg[-1].argmax()))
    return driver, seqs


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa", "glm4_moe"])
def test_a_reallocated_page_is_detected_and_isolated(arch: str, tmp_path: Path) -> None:
    path = make_tiny(arch, tmp_path / arch)
    clean_driver, clean_seqs = _prefilled(path)
    clean = clean_driver.run(clean_seqs, [1, 1])
    assert not clean_driver.last_mismatch.any()

    driver, seqs = _prefilled(path)
    driver.kv.page_tags[seqs[0].pages[0]] += 1  # the block manager gave page 0 of sequence 0 to someone else
    out = driver.run(seqs, [1, 1])
    assert driver.last_mismatch.tolist() == [True, False]
    # the other sequence is untouched (up to float reassociation: MoE groups tokens by expert)
    torch.testing.assert_close(out[1], clean[1], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out[0]).all()
    assert float((out[0] - clean[0]).abs().max()) > 1e-3  # the first 16 tokens were not read


def test_a_write_into_a_reallocated_page_does_not_land(tmp_path: Path) -> None:
    driver, seqs = _prefilled(make_tiny("glm4_moe", tmp_path / "g"))
    page = seqs[1].pages[-1]  # sequence 1 (20 tokens) writes its next token into its second page
    driver.kv.page_tags[page] += 1
    before = [layer["k"][page].clone() for layer in driver.kv.layers]
    driver.run(seqs, [1, 1])
    assert driver.last_mismatch.tolist() == [False, True]
    assert all(torch.equal(layer["k"][page], b) for layer, b in zip(driver.kv.layers, before, strict=True))

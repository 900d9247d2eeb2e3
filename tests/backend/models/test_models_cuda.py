"""The reference model path on a GPU computes what it computes on the CPU (device tool only)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from backend.models.loader import load_model
from backend.tools.random_checkpoint import KINDS, write_random_checkpoint
from tests.backend.conformance import prompts
from tests.backend.paged_driver import PagedDriver

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("kind", KINDS)
def test_cuda_matches_cpu(kind: str, tmp_path: Path) -> None:
    path = write_random_checkpoint(kind, tmp_path / kind, dtype=torch.float32)
    cpu = load_model(path, dtype=torch.float32)
    ps = prompts(cpu.config.vocab_size, (17, 33))
    _, expected = PagedDriver(cpu.model).prefill(ps, 16)
    gpu = load_model(path, dtype=torch.float32, device="cuda")
    driver = PagedDriver(gpu.model, device="cuda")
    _, got = driver.prefill(ps, 16)
    assert not driver.last_mismatch.any()
    for g, e in zip(got, expected, strict=True):
        assert g.device.type == "cuda"
        torch.testing.assert_close(g.cpu(), e, atol=1e-4, rtol=1e-4)
    assert PagedDriver(cpu.model).greedy(ps, 8, 16) == PagedDriver(gpu.model, device="cuda").greedy(ps, 8, 16)

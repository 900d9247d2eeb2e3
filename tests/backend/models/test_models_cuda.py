"""The reference model path on a GPU computes what it computes on the CPU (device tool only)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def test_an_eager_moe_forward_on_cuda_waits_for_nothing(tmp_path: Path) -> None:
    """An eager forward's unquantized routed experts on CUDA (a prefill, a speculative step's host
    path or MTP catch-up: 2026-12-05's profiles held 8 syncs and ~80 launches per MoE layer of each
    nano prefill) run every expert over every token while the work is small: no host sync (sync
    debug mode "error"), no `unique` or `nonzero`, and the loop's sum (the CPU's)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from backend.models.layers.moe import Experts
    from tests.backend.tiny_checkpoints import make_tiny

    class Names(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: set[str] = set()

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            self.names.add(str(func.overloadpacket.__name__))
            return func(*args, **(kwargs or {}))

    path = make_tiny("deepseek_v3", tmp_path / "ds")
    gpu = load_model(path, dtype=torch.float32, device="cuda").model
    cpu = load_model(path, dtype=torch.float32).model
    experts, ref = (next(m for m in model.modules() if isinstance(m, Experts)) for model in (gpu, cpu))
    T, E, H = 300, ref.e1 - ref.e0, ref.gate_up_proj.shape[2]
    g = torch.Generator().manual_seed(0)
    x, weights = torch.randn(T, H, generator=g), torch.rand(T, 2, generator=g)
    ids = torch.stack([torch.randperm(E, generator=g)[:2] for _ in range(T)])  # [T, 2] distinct
    want = ref(x, weights, ids)
    on_device = x.cuda(), weights.cuda(), ids.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        with Names() as seen:
            got = experts(*on_device)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert not seen.names & {"nonzero", "_unique2", "unique_dim", "_local_scalar_dense"}, seen.names
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("index_topk", [64, 4], ids=["dense", "scoring"])
@pytest.mark.parametrize(
    ("fmt", "fp8_method"), [("bf16", "fp8-block"), ("int4-all", "fp8-block"), ("fp8-all", "fp8-channel")]
)
def test_fused_glm5_matches_the_unfused_one_on_cuda(fmt: str, fp8_method: str, index_topk: int) -> None:
    """The fused model's products on the GPU kernels (q_b_proj with the indexer's wq_b as one
    product, or q_b_proj's row prefix alone when the step scores nothing) against the unfused one's:
    a wider product may reduce in another order, so to float32 rounding, not to the bit."""
    from tests.backend.models.test_models_fused import decode_and_draft, models

    plain, fused = models(fmt, fp8_method, index_topk, device="cuda")
    a, b = decode_and_draft(plain, "cuda"), decode_and_draft(fused, "cuda")
    for x, y in [*zip(a[0], b[0], strict=True), (a[1], b[1]), (a[2], b[2])]:
        torch.testing.assert_close(y, x, atol=1e-3, rtol=1e-3)

"""The MoE gate's GEMV in one Triton launch against `F.linear(x.float(), weight)`: float32 logits of a
bf16 hidden state, within float32 rounding of the sum (the kernel's order is its own), deterministic;
expert counts past one block, a hidden size past one step and not a multiple of it, several tokens,
and the op's entry falling back to torch off CUDA and for prefill.

CPU CI runs the kernel under TRITON_INTERPRET=1."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import kernels.router_logits as entry  # noqa: E402
from kernels.router_logits import RouterLogitsArgs, router_logits, router_logits_ref  # noqa: E402
from kernels.router_logits_triton import router_logits_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("T", "E", "H"), [(1, 256, 2048), (2, 7, 1500), (3, 33, 96)])
def test_matches_the_float32_linear(dtype: torch.dtype, T: int, E: int, H: int) -> None:
    g = torch.Generator().manual_seed(T * E + H)
    x = (
        torch.randn(T, 2 * H, generator=g).to(dtype)[:, :H].to(DEV)
    )  # strided rows: a view, as normed x may be
    w = (torch.randn(E, H, generator=g) * H**-0.5).to(DEV)
    out = router_logits_triton(x, w)
    ref = F.linear(x.float(), w)
    assert out.shape == (T, E) and out.dtype == torch.float32
    # float32 sums of H products in another order: a few units in the last place of the row's scale
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    assert torch.equal(out, router_logits_triton(x, w))  # a fixed order: the same bits every time


def test_the_entry_runs_the_kernel_for_decode_on_cuda_and_torch_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 64, generator=g).bfloat16().to(DEV)
    w = torch.randn(16, 64, generator=g).to(DEV)
    ran: list[int] = []
    kernel = router_logits_triton

    def counted(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ran.append(x.shape[0])
        return kernel(x, w)

    monkeypatch.setattr("kernels.router_logits_triton.router_logits_triton", counted)
    out = router_logits(RouterLogitsArgs(x, w))
    torch.testing.assert_close(out, router_logits_ref(x, w), rtol=1e-5, atol=1e-5)
    assert ran == ([2] if DEV == "cuda" else [])
    many = torch.randn(entry.GEMV_MAX_TOKENS + 1, 64, generator=g).bfloat16().to(DEV)
    assert torch.equal(router_logits(RouterLogitsArgs(many, w)), router_logits_ref(many, w))  # prefill: torch
    assert ran == ([2] if DEV == "cuda" else [])


def test_bad_operands_are_refused() -> None:
    x, w = torch.zeros(2, 8, device=DEV), torch.zeros(4, 8, device=DEV)
    with pytest.raises(ValueError, match="fit"):
        router_logits_triton(x, w[:, :4])
    with pytest.raises(ValueError, match="unit stride"):
        router_logits_triton(torch.zeros(8, 2, device=DEV).t(), w)
    with pytest.raises(TypeError, match="float32 weight"):
        router_logits_triton(x, w.bfloat16())

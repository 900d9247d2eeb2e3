"""`int4_linear`, the INT4 Linear entry: the torch reference off CUDA (dequantize to the activation
dtype, then a matmul), the W4A16 kernels on CUDA at every M against it and an independent float64
product (device tool for those)."""

from __future__ import annotations

import pytest
import torch

from kernels.formats.int4 import dequantize_int4, quantize_int4, unpack
from kernels.int4_linear import Int4LinearArgs, can_run_kernel, int4_linear, int4_linear_ref


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def expected(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, K: int, group: int) -> torch.Tensor:
    w = unpack(packed, K).double() * scale.double().repeat_interleave(group, dim=1)[:, :K]
    return x.double() @ w.t()


def test_entry_off_cuda_is_the_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(40, 96, generator=gen) * 0.05
    packed, scale = quantize_int4(w, 32)
    x = torch.randn(3, 96, generator=gen).to(torch.bfloat16)
    args = Int4LinearArgs(x, packed, scale, 96, 32)
    assert not can_run_kernel(args)
    want = x @ dequantize_int4(packed, scale, 96, 32, torch.bfloat16).t()
    assert torch.equal(int4_linear(args), want)
    assert torch.equal(int4_linear_ref(args), want)


def test_partial_groups_stay_on_the_reference() -> None:
    """K not a whole number of groups (the format allows it, the kernels do not)."""
    packed, scale = quantize_int4(torch.randn(8, 80), 32)  # 80 = 2.5 groups
    args = Int4LinearArgs(torch.randn(1, 80), packed, scale, 80, 32)
    assert not can_run_kernel(args)
    assert rel_err(int4_linear(args), expected(args.x, packed, scale, 80, 32)) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 3, 16, 64, 65, 2048])
@pytest.mark.parametrize(
    ("N", "K", "group", "dtype"),
    [(576, 6144, 32, torch.bfloat16), (32, 6144, 32, torch.float32), (2048, 4096, 128, torch.bfloat16)],
)
def test_kernels_on_gpu(M: int, N: int, K: int, group: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(M + N)
    packed, scale = quantize_int4(torch.randn(N, K, generator=gen) * 0.02, group)
    x = torch.randn(M, K, generator=gen).to(dtype)
    args = Int4LinearArgs(x.cuda(), packed.cuda(), scale.cuda(), K, group)
    assert can_run_kernel(args)
    out = int4_linear(args).cpu()
    assert out.dtype == dtype
    assert rel_err(out, expected(x, packed, scale, K, group)) < 1e-2
    assert rel_err(out, int4_linear_ref(args).cpu()) < 1e-2

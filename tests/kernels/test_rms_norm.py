"""Triton RMSNorm (+ residual add) against rms_norm_ref: the sum h exact, the norm within a rounding
of the output dtype (the mean sums in another order); odd widths, strided rows, a slice as `out`.

CPU CI runs the kernel under TRITON_INTERPRET=1 (whose float32 -> bfloat16 cast truncates, where the
GPU rounds to nearest even: one more unit in the last place there)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.rms_norm import rms_norm_ref  # noqa: E402
from kernels.rms_norm_triton import rms_norm_triton  # noqa: E402
from tests.kernels.sm90_compile import compiled_lines  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    tol = {torch.bfloat16: 8e-3 if DEV == "cuda" else 1.6e-2, torch.float32: 1e-5}[a.dtype]
    torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("N", "D"), [(1, 64), (3, 100), (5, 512)])
def test_matches_reference(dtype: torch.dtype, N: int, D: int) -> None:
    g = torch.Generator().manual_seed(N * D)
    x = (torch.randn(N, D, generator=g) * 3).to(dtype).to(DEV)
    w = (torch.rand(D, generator=g) + 0.5).to(dtype).to(DEV)
    out, h = rms_norm_triton(x, w, 1e-6)
    ref, _ = rms_norm_ref(x, w, 1e-6)
    assert h is x and out.dtype == ref.dtype
    close(out, ref)


def test_residual_sum_is_exact_and_returned() -> None:
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 96, generator=g) * 5).bfloat16().to(DEV)
    r = (torch.randn(4, 96, generator=g) * 5).bfloat16().to(DEV)
    w = torch.rand(96, generator=g).bfloat16().to(DEV)
    out, h = rms_norm_triton(x, w, 1e-5, residual=r)
    ref, ref_h = rms_norm_ref(x, w, 1e-5, residual=r)
    if DEV == "cuda":
        assert torch.equal(h, ref_h)
    close(h, ref_h)
    close(out, ref)


def test_strided_rows_into_a_slice_of_out() -> None:
    """x a column slice of a wider row (kv_a_proj's [c | k_pe]), out a slice of the latent line."""
    g = torch.Generator().manual_seed(2)
    wide = torch.randn(3, 72, generator=g).bfloat16().to(DEV)
    x = wide[:, :64]
    w = torch.rand(64, generator=g).bfloat16().to(DEV)
    line = torch.full((3, 72), 7.0, dtype=torch.bfloat16, device=DEV)
    rms_norm_triton(x, w, 1e-6, out=line[:, :64])
    close(line[:, :64], rms_norm_ref(x, w, 1e-6)[0])
    assert torch.all(line[:, 64:] == 7.0)  # nothing past the slice written


def test_fp32_input_with_bf16_weight_promotes() -> None:
    x = torch.randn(2, 40).to(DEV)
    w = torch.rand(40).bfloat16().to(DEV)
    out, _ = rms_norm_triton(x, w, 1e-6)
    ref, _ = rms_norm_ref(x, w, 1e-6)
    assert out.dtype == torch.float32
    close(out, ref)


def test_bad_shapes_raise() -> None:
    x = torch.randn(2, 8, device=DEV)
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(x, torch.ones(9, device=DEV), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(x, torch.ones(8, device=DEV), 1e-6, residual=torch.zeros(2, 8, dtype=torch.bfloat16))


def test_small_decode_ops_compile_for_sm90_without_spills() -> None:
    """RMSNorm, the LoRA row norms, SiLU · up (plain and routed), rotary (one tensor and four), routing and the DSA
    selection (keys, radix streamed and resident) and the greedy verify's tail lowered for the H200 (the interpreter never lowers them) at GLM-5's shapes:
    every kernel compiles, none spills."""
    lines = compiled_lines("tests.kernels.sm90_compile_small_ops")
    assert len(lines) == 20, lines
    assert all("0 bytes spill stores" in line for line in lines), lines

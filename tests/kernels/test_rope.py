"""Triton rotary embedding against rope_ref: the same bytes (each product and sum rounds to the
dtype on both sides), interleaved and NeoX, with and without dims passed through, strided input,
a slice of a larger buffer as `out`.

CPU CI runs the kernel under TRITON_INTERPRET=1, whose float32 -> bfloat16 cast truncates where the
GPU's rounds to nearest even: there bf16 results may differ by one unit in the last place, so they
are compared within a few (three truncations, then a difference), fp16 and every GPU run to the byte."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.rope import rope_ref  # noqa: E402
from kernels.rope_triton import rope_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET_BF16_TOL = 2**-5  # 4 bf16 units in the last place, relative


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    if DEV == "cuda" or a.dtype != torch.bfloat16:
        assert torch.equal(a, b)
    else:
        torch.testing.assert_close(a, b, rtol=INTERPRET_BF16_TOL, atol=2**-5)


pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def cos_sin(T: int, half: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    angle = torch.rand(T, half, generator=g) * 50
    return (angle.cos() * 1.2).to(dtype).to(DEV), (angle.sin() * 1.2).to(dtype).to(DEV)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_interleaved", [True, False])
@pytest.mark.parametrize(("T", "Hx", "Dx", "dim"), [(1, 1, 64, 64), (3, 5, 48, 16), (2, 3, 20, 12)])
def test_same_bytes_as_reference(
    dtype: torch.dtype, is_interleaved: bool, T: int, Hx: int, Dx: int, dim: int
) -> None:
    g = torch.Generator().manual_seed(T * 100 + Hx * 10 + Dx)
    x = (torch.randn(T, Hx, Dx, generator=g) * 4).to(dtype).to(DEV)
    cos, sin = cos_sin(T, dim // 2, dtype, g)
    same(rope_triton(x, cos, sin, dim, is_interleaved), rope_ref(x, cos, sin, dim, is_interleaved))


def test_strided_input_into_a_slice() -> None:
    """q_pe a column slice of q [T, H, N + Dr] written into the absorbed query's last Dr dims."""
    g = torch.Generator().manual_seed(3)
    T, H, N, Dr, R = 3, 4, 24, 16, 32
    q = torch.randn(T, H, N + Dr, generator=g).bfloat16().to(DEV)
    q_pe = q[..., N:]
    cos, sin = cos_sin(T, Dr // 2, torch.bfloat16, g)
    buf = torch.full((T, H, R + Dr), 9.0, dtype=torch.bfloat16, device=DEV)
    rope_triton(q_pe, cos, sin, Dr, True, out=buf[..., R:])
    same(buf[..., R:], rope_ref(q_pe, cos, sin, Dr, True))
    assert torch.all(buf[..., :R] == 9.0)


def test_bad_arguments_raise() -> None:
    x = torch.randn(2, 1, 8, device=DEV)
    cos = torch.ones(2, 4, device=DEV)
    with pytest.raises(ValueError, match="dim"):
        rope_triton(x, cos, cos, 10, True)
    with pytest.raises(ValueError, match="cos"):
        rope_triton(x, cos.half(), cos, 8, True)

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

from kernels.rope import RopeArgs, rope, rope_ref  # noqa: E402
from kernels.rope_triton import rope_many_triton, rope_triton  # noqa: E402

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


@pytest.mark.parametrize("is_interleaved", [True, False])
def test_many_tensors_in_one_launch(is_interleaved: bool) -> None:
    """A DSA layer's four rotations at shrunken shapes: the latent's k_pe [T, 1, Dr] into a slice of the
    cache line, q_pe (a column slice of q) into the absorbed query's last Dr dims, the indexer's key
    [T, 1, Di] and query [T, Hi, Di] with dims past Dr passed through; each as rope_ref, the buffers
    around the slices untouched. Heads 1, 5 and 3 under one BLOCK_H: the masks of each tensor's blocks."""
    g = torch.Generator().manual_seed(11 + is_interleaved)
    T, H, N, Dr, R, Hi, Di = 3, 5, 8, 16, 24, 3, 40
    cos, sin = cos_sin(T, Dr // 2, torch.bfloat16, g)
    kv_a = torch.randn(T, R + Dr, generator=g).bfloat16().to(DEV)
    q = torch.randn(T, H, N + Dr, generator=g).bfloat16().to(DEV)
    k_idx = torch.randn(T, 1, Di, generator=g).bfloat16().to(DEV)
    q_idx = torch.randn(T, Hi, Di, generator=g).bfloat16().to(DEV)
    latent = torch.full((T, R + Dr), 7.0, dtype=torch.bfloat16, device=DEV)
    q_abs = torch.full((T, H, R + Dr), 9.0, dtype=torch.bfloat16, device=DEV)
    k_pe, q_pe = kv_a[:, None, R:], q[..., N:]
    outs = rope_many_triton(
        [k_pe, q_pe, k_idx, q_idx],
        cos,
        sin,
        Dr,
        is_interleaved,
        [latent[:, None, R:], q_abs[..., R:], None, None],
    )
    for x, out in zip([k_pe, q_pe, k_idx, q_idx], outs, strict=True):
        same(out, rope_ref(x, cos, sin, Dr, is_interleaved))
    assert outs[0].data_ptr() == latent[:, None, R:].data_ptr() and torch.all(latent[:, :R] == 7.0)
    assert torch.all(q_abs[..., :R] == 9.0)
    # the op's entry takes the same tensors (the reference on the CPU, the kernel on CUDA)
    again = rope(RopeArgs((k_pe, q_pe, k_idx, q_idx), cos, sin, Dr, is_interleaved))
    for a, b in zip(again, outs, strict=True):
        same(a, b)


def test_bad_arguments_raise() -> None:
    x = torch.randn(2, 1, 8, device=DEV)
    cos = torch.ones(2, 4, device=DEV)
    with pytest.raises(ValueError, match="dim"):
        rope_triton(x, cos, cos, 10, True)
    with pytest.raises(ValueError, match="cos"):
        rope_triton(x, cos.half(), cos, 8, True)
    with pytest.raises(ValueError, match="tokens"):
        rope_many_triton([x, torch.randn(3, 1, 8, device=DEV)], cos, cos, 8, True, [None, None])
    with pytest.raises(ValueError, match="1 to 4"):
        rope_many_triton([x] * 5, cos, cos, 8, True, [None] * 5)

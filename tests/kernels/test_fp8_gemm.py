"""Weight-only FP8 GEMV/GEMM (`kernels/fp8_gemm.py`) and its entry `fp8_linear` against an independent
float64 reference of the dequantized weights.

CPU CI runs the Triton kernels under TRITON_INTERPRET=1 (fp16/fp32 activations: bf16 tl.dot is
broken in the interpreter); the `gpu` tests run bf16 on the device at real shapes.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.formats.fp8 import dequantize_fp8, quantize_fp8_block, quantize_fp8_channel  # noqa: E402
from kernels.fp8_gemm import Fp8GemmConfig, fp8_gemm, pick_config  # noqa: E402
from kernels.fp8_linear import Fp8LinearArgs, fp8_linear, fp8_linear_ref  # noqa: E402
from tests.kernels.sm90_compile import compiled_lines  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def make_weight(
    N: int, K: int, block: tuple[int, int] | None, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    w = torch.randn(N, K, generator=gen) * 0.05
    w[:, : K // 3] *= 4.0  # blocks of different ranges: each its own scale
    return quantize_fp8_channel(w) if block is None else quantize_fp8_block(w, block)


def expected(
    x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """float64: e4m3 values are exact in it, as are their products with an fp32 scale."""
    n, k = q.shape
    if block is None:
        s = scale.double().view(-1, 1)
    else:
        s = scale.double().repeat_interleave(block[0], 0)[:n].repeat_interleave(block[1], 1)[:, :k]
    return x.double() @ (q.double() * s).t()


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


CASES = [
    # M, N, K, block, config (None: the launcher's own choice)
    (1, 72, 200, None, None),  # GEMV, N and K off the tiles, per channel
    (1, 200, 384, (128, 128), Fp8GemmConfig(0, 64, 128, split_k=2)),  # GEMV, partial row block, split K
    (2, 96, 320, (128, 128), Fp8GemmConfig(0, 32, 64, split_k=3)),  # two rows, partial K block, uneven split
    (1, 130, 256, (128, 128), None),  # the launcher's split
    (3, 72, 200, None, None),  # tiles, M below the tile, per channel
    (17, 150, 300, (128, 128), Fp8GemmConfig(16, 64, 128, split_k=2)),  # tiles, every edge partial
    (40, 64, 256, (64, 128), Fp8GemmConfig(32, 32, 64, split_k=1)),  # two M tiles, 64-row blocks
]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(("M", "N", "K", "block", "config"), CASES)
def test_kernel_matches_reference(
    M: int, N: int, K: int, block: tuple[int, int] | None, config: Fp8GemmConfig | None, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(M * 1000 + N + K)
    q, s = make_weight(N, K, block, gen)
    x = torch.randn(M, K, generator=gen).to(dtype)
    out = fp8_gemm(x.to(DEV), q.to(DEV), s.to(DEV), block, config=config)
    assert out.dtype == dtype and out.shape == (M, N)
    tol = 2e-3 if dtype == torch.float16 else 1e-5
    assert rel_err(out.cpu(), expected(x, q, s, block)) < tol


def test_results_repeat_and_counters_reset() -> None:
    """Split K finishes in a fixed order: a second call (counters reset by the kernel) gives the same bits."""
    gen = torch.Generator().manual_seed(7)
    q, s = make_weight(64, 512, (128, 128), gen)
    x = torch.randn(1, 512, generator=gen).to(DEV)
    cfg = Fp8GemmConfig(0, 64, 128, split_k=4)
    a = fp8_gemm(x, q.to(DEV), s.to(DEV), (128, 128), config=cfg)
    b = fp8_gemm(x, q.to(DEV), s.to(DEV), (128, 128), config=cfg)
    assert torch.equal(a, b)


def test_leading_dims_and_shape_errors() -> None:
    gen = torch.Generator().manual_seed(3)
    q, s = make_weight(48, 128, None, gen)
    x = torch.randn(2, 1, 128, generator=gen)
    out = fp8_gemm(x.to(DEV), q.to(DEV), s.to(DEV), None)
    assert out.shape == (2, 1, 48)
    assert rel_err(out.cpu(), expected(x.view(2, 128), q, s, None).view(2, 1, 48)) < 1e-5
    with pytest.raises(ValueError, match="does not fit"):
        fp8_gemm(torch.randn(1, 64).to(DEV), q.to(DEV), s.to(DEV), None)
    with pytest.raises(ValueError, match="must divide"):
        qb, sb = make_weight(48, 128, (32, 128), gen)
        fp8_gemm(x.to(DEV), qb.to(DEV), sb.to(DEV), (32, 128))


def test_pick_config_fills_the_gpu_by_splitting_k() -> None:
    one = pick_config(1, 576, 6144, 132)  # kv_a_proj at one token: 9 N tiles
    assert one.block_m == 0 and one.split_k > 1
    wide = pick_config(1, 16384, 2048, 132)  # q_b_proj: 256 N tiles already
    assert wide.split_k < one.split_k and 256 * wide.split_k <= 2 * 8 * 132
    assert pick_config(48, 4096, 4096, 132).block_m == 64


def test_entry_reference_is_dequantize_then_matmul() -> None:
    """Off CUDA (and at prefill sizes on it) the entry is the reference: the weight dequantized to
    the activation dtype, then a matmul in it."""
    gen = torch.Generator().manual_seed(5)
    q, s = make_weight(40, 256, (128, 128), gen)
    x = torch.randn(5, 256, generator=gen).to(torch.bfloat16)
    args = Fp8LinearArgs(x, q, s, (128, 128))
    want = x @ dequantize_fp8(q, s, (128, 128), torch.bfloat16).t()
    assert torch.equal(fp8_linear(args), want)
    assert torch.equal(fp8_linear_ref(args), want)


def test_kernels_compile_for_sm90_without_spills() -> None:
    """Every config the entry launches, lowered for the H200 (ptxas, no GPU; a process without
    TRITON_INTERPRET)."""
    lines = compiled_lines("tests.kernels.sm90_compile_fp8")
    assert len(lines) == 4 + 2 * 3  # the GEMV at bf16 / fp32, the three tiles at bf16; block and channel
    for line in lines:
        assert "0 bytes spill stores" in line, line


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 2, 5, 16, 64, 65, 300])
@pytest.mark.parametrize(
    ("N", "K", "block"), [(576, 6144, (128, 128)), (6144, 16384, (128, 128)), (2048, 7168, None)]
)
def test_bf16_on_gpu_matches_dequantize_then_matmul(
    M: int, N: int, K: int, block: tuple[int, int] | None
) -> None:
    gen = torch.Generator().manual_seed(M + N)
    q, s = make_weight(N, K, block, gen)
    x = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    args = Fp8LinearArgs(x.cuda(), q.cuda(), s.cuda(), block)
    out = fp8_linear(args).cpu()
    ref = fp8_linear_ref(args).cpu()
    truth = expected(x, q, s, block)
    assert not out.isnan().any()
    assert rel_err(out, truth) < 1e-2
    assert rel_err(out, ref) < 1e-2  # the path it replaces, within bf16 rounding

"""W4A8 prefill (kernels/w4a8_gemm.py) and the expand-fp8 alternative (kernels/w4a8_expand.py).

CPU CI runs the Triton kernels under TRITON_INTERPRET=1. Triton 3.6's interpreter does run FP8:
e4m3 `tl.dot` on exactly representable operands is exact and int -> e4m3 casts are right (tried
before writing these tests), so the kernels are tested as they run on the H200, e4m3 operands and
all, not through a float16 stand-in. What the interpreter gets wrong is fp32 -> e4m3 rounding that
carries into the exponent (126.6 becomes 64, not 128; docs/README.md), so the CPU tests of the two
kernels that round (the per-token quantizer, the expansion) use inputs whose codes are exact, and the
GEMM is checked on codes from the torch quantizer; byte-exact rounding is checked in the gpu tests.

Error bound of W4A8 against W4A16 (the gpu tests), derived: the INT4 weights are the same exactly
(q - 8 is exact in e4m3, the group scale is applied in fp32), so the difference is the activations'
rounding to e4m3, `x̂ = x (1 + δ)` with |δ| ≤ u = 2^-4 (3 mantissa bits, round to nearest) for every
x above e4m3's normal floor (2^-6 · absmax / 448: below it the absolute error is ≤ 2^-10 · absmax /
448, negligible on random rows). The error of y_n = Σ_k x_k w_kn is e_n = Σ_k x_k δ_k w_kn; with the
rounding errors uncorrelated with the data's signs, E‖e‖² = Σ_n Σ_k x_k² w_kn² E[δ²] ≤ u² ‖y‖² in
expectation over random data, so ‖e‖ / ‖y‖ ≤ u. (The expected value is smaller, ~0.025: the mean
square of δ within a binade is below u².) Bound used: 2^-4, plus the bf16 output rounding (2^-9) of
each side. Expand-fp8 adds the weights' re-rounding to e4m3 (same u per weight, independent of the
activations' errors): ≤ √2 · u.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.w4a8_expand import expand_int4_fp8, expand_int4_fp8_ref, w4a8_expand_gemm  # noqa: E402
from kernels.w4a8_gemm import (  # noqa: E402
    FP8,
    W4A8Config,
    quantize_fp8_rows,
    quantize_fp8_rows_ref,
    w4a8_gemm,
    w4a8_gemm_ref,
)
from tests.kernels.sm90_compile import compiled_lines  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"
U = 2.0**-4  # e4m3 unit roundoff
BF16_OUT = 2.0**-9
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[N, K] int8 in [-8, 7] -> [N, K/8] int32, nibble j of word i = q[8i + j] + 8."""
    nib = (q.to(torch.int64) + 8).reshape(q.shape[0], -1, 8)  # [N, K/8, 8]
    words = (nib << torch.arange(0, 32, 4, device=q.device)).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def checkpoint(
    N: int, K: int, group: int, gen: torch.Generator, dev: str = "cpu"
) -> tuple[torch.Tensor, ...]:
    """(weight_packed [N, K/8], weight_scale bf16 [N, K/G], q int8 [N, K])."""
    q = torch.randint(-8, 8, (N, K), generator=gen, dtype=torch.int8, device=dev)
    scale = (torch.rand(N, K // group, generator=gen, device=dev) * 0.02 + 0.002).to(torch.bfloat16)
    return pack_int4(q), scale, q


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def e4m3_rows(M: int, K: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(x [M, K] fp32, codes [M, K] fp32): rows of e4m3 values times 2^e, each holding ±448 once, so
    the row scale is exactly 2^e and every x / scale is an e4m3 value (no rounding to test)."""
    codes = torch.randn(M, K, generator=gen).mul(64).clamp(-440, 440).to(FP8).float()
    codes[:, 0] = torch.where(torch.rand(M, generator=gen) < 0.5, -448.0, 448.0)
    e = torch.randint(-12, 4, (M, 1), generator=gen).float()
    return codes * torch.exp2(e), codes


# --- CPU (interpreter) ------------------------------------------------------------------------------


def test_quantize_rows_exact_codes_and_padding() -> None:
    gen = torch.Generator().manual_seed(0)
    x, codes = e4m3_rows(5, 200, gen)
    x[3] = 0.0  # an all-zero row: a positive scale, every code 0
    q, s = quantize_fp8_rows(x.to(DEV), pad_to=16)
    assert q.shape == (16, 200) and s.shape == (16, 1) and q.dtype == FP8
    rq, rs = quantize_fp8_rows_ref(x)
    assert torch.equal(q[:5].cpu().view(torch.uint8), rq.view(torch.uint8))
    assert torch.equal(s[:5].cpu(), rs)
    codes[3] = 0.0
    assert torch.equal(q[:5].cpu().float(), codes)
    assert torch.equal((q[:5].cpu().float() * s[:5].cpu()), x)  # x == codes · scale exactly
    assert not q[5:].cpu().float().any() and bool((s[5:] > 0).all())  # padding rows: zero codes


@pytest.mark.parametrize(
    ("M", "N", "K", "group", "cfg"),
    [
        (37, 40, 192, 32, W4A8Config(32, 32, 128, num_warps=4, swap_xw=True)),  # K tail, 4 chunks/tile
        (37, 40, 192, 32, W4A8Config(32, 32, 64, num_warps=4, swap_xw=False)),
        (19, 24, 256, 64, W4A8Config(16, 16, 128, num_warps=4, group_m=2)),  # 2 chunks of 64
        (21, 33, 384, 128, W4A8Config(16, 32, 128, num_warps=4, swap_xw=False)),  # 1 chunk, 3 groups
        (9, 16, 256, 256, W4A8Config(16, 16, 128, num_warps=4)),  # group > block_k: 2 chunks per group
    ],
)
def test_w4a8_gemm_matches_reference(M: int, N: int, K: int, group: int, cfg: W4A8Config) -> None:
    """Codes from the torch quantizer; fp32 output against the fp32 reference (summation order only)."""
    gen = torch.Generator().manual_seed(M * N + K)
    packed, scale, _ = checkpoint(N, K, group, gen)
    x = torch.randn(M, K, generator=gen)
    xq, xs = quantize_fp8_rows_ref(x)
    out = torch.full((M, N), float("nan"), device=DEV)
    w4a8_gemm(
        x.to(DEV), packed.to(DEV), scale.to(DEV), group, config=cfg, out=out, xq=(xq.to(DEV), xs.to(DEV))
    )
    assert rel_err(out.cpu(), w4a8_gemm_ref(xq, xs, packed, scale)) < 1e-5


def test_w4a8_gemm_end_to_end_fp16() -> None:
    """fp16 activations through the launcher's own quantizer and default tiles; the leading dims kept."""
    gen = torch.Generator().manual_seed(1)
    packed, scale, q = checkpoint(24, 128, 32, gen)
    x = torch.randn(2, 9, 128, generator=gen).half()
    out = w4a8_gemm(
        x.to(DEV), packed.to(DEV), scale.to(DEV), 32, config=W4A8Config(16, 16, 64, num_warps=4)
    ).cpu()
    assert out.shape == (2, 9, 24) and out.dtype == torch.float16
    xq, xs = (t.cpu() for t in quantize_fp8_rows(x.reshape(-1, 128).to(DEV)))
    ref = w4a8_gemm_ref(xq, xs, packed, scale)
    assert rel_err(out.reshape(-1, 24), ref) < 2e-3  # fp16 output rounding
    w = q.float() * scale.float().repeat_interleave(32, dim=1)  # independent: codes · scales, fp64
    exact = (xq.double() * xs.double()) @ w.double().t()
    assert rel_err(ref, exact) < 1e-6


def test_w4a8_gemm_rejects_bad_arguments() -> None:
    gen = torch.Generator().manual_seed(2)
    packed, scale, _ = checkpoint(16, 64, 32, gen)
    x = torch.randn(3, 64)
    with pytest.raises(ValueError, match="group_size"):
        w4a8_gemm(x, packed, scale.repeat_interleave(2, dim=1), 16)  # FP8 dots take K >= 32
    with pytest.raises(ValueError, match="K="):
        w4a8_gemm(torch.randn(3, 72), packed, scale, 32)
    with pytest.raises(TypeError):
        w4a8_gemm(x.double(), packed, scale, 32)
    with pytest.raises(ValueError, match="does not cover"):
        w4a8_gemm(x, packed, scale, 32, xq=quantize_fp8_rows_ref(x[:2]))


def test_expand_exact_when_group_scales_are_powers_of_two_apart() -> None:
    """Power-of-two scales: the codes (q - 8) · 32 · 2^-j are e4m3 values, which the expansion must
    give exactly (no rounding: see the module docstring), and channel scales max_g s / 32."""
    gen = torch.Generator().manual_seed(3)
    N, K, group = 20, 192, 32
    packed, _, q = checkpoint(N, K, group, gen)
    smax = torch.exp2(-torch.randint(6, 10, (N, 1), generator=gen).float())  # 32 / smax exact too
    j = torch.randint(0, 5, (N, K // group), generator=gen)
    j[:, 0] = 0  # the largest group of each row
    scale = (smax * torch.exp2(-j.float())).to(torch.bfloat16)
    w8, c = expand_int4_fp8(packed.to(DEV), scale.to(DEV), group)
    r8, rc = expand_int4_fp8_ref(packed, scale)
    assert torch.equal(w8.cpu().view(torch.uint8), r8.view(torch.uint8))
    assert torch.equal(c.cpu(), rc) and torch.equal(rc, scale.float().amax(1) / 32)
    assert torch.equal(w8.cpu().float(), q.float() * 32 * torch.exp2(-j.float()).repeat_interleave(group, 1))


def test_expand_gemm_scales_rows_and_columns() -> None:
    """The whole expand-fp8 product (torch 2.13's CPU `_scaled_mm` takes row-wise scales too): exact
    codes on both sides, so only the bf16 output rounds; row scales on x, channel scales on w."""
    gen = torch.Generator().manual_seed(4)
    N, K, group = 32, 128, 32
    packed, _, _ = checkpoint(N, K, group, gen)
    scale = torch.exp2(-torch.randint(6, 10, (N, K // group), generator=gen).float()).to(torch.bfloat16)
    x, _ = e4m3_rows(21, K, gen)
    out = w4a8_expand_gemm(x.to(torch.bfloat16).to(DEV), packed.to(DEV), scale.to(DEV), group)
    assert out.shape == (21, N) and out.dtype == torch.bfloat16
    w8, c = expand_int4_fp8_ref(packed, scale)
    exact = x.double() @ (w8.double() * c.double()[:, None]).t()
    assert rel_err(out.cpu(), exact) < 2 * BF16_OUT


def test_expand_gemm_chunks_wide_weights_to_the_same_output(monkeypatch: pytest.MonkeyPatch) -> None:
    """Weights wider than the scratch bound go through in row chunks into one output: the same bytes
    as the one-chunk path, which returns the product itself (bf16 or the activations' fp16)."""
    import kernels.w4a8_expand as expand_module

    gen = torch.Generator().manual_seed(6)
    N, K, group = 48, 128, 32
    packed, scale, _ = checkpoint(N, K, group, gen)
    x = torch.randn(5, 3, K, generator=gen)
    for dtype in (torch.bfloat16, torch.float16):
        whole = w4a8_expand_gemm(x.to(dtype).to(DEV), packed.to(DEV), scale.to(DEV), group)
        monkeypatch.setattr(expand_module, "_CHUNK_BYTES", 16 * K)  # 16 rows a chunk: 3 chunks
        chunked = w4a8_expand_gemm(x.to(dtype).to(DEV), packed.to(DEV), scale.to(DEV), group)
        monkeypatch.undo()
        assert whole.shape == chunked.shape == (5, 3, N) and whole.dtype == chunked.dtype == dtype
        assert torch.equal(whole.cpu(), chunked.cpu())


def test_kernels_compile_for_sm90() -> None:
    """The W4A8 GEMM (group 32 and 128), the quantizer and the expansion compile for the H200 with
    their default tiles (Triton + ptxas, no GPU; a process without TRITON_INTERPRET); none spills."""
    lines = compiled_lines("tests.kernels.sm90_compile_w4a8")
    assert len(lines) == 4 and all(" 0 bytes spill stores" in line for line in lines), lines


# --- GPU: bf16, real shapes -------------------------------------------------------------------------

SHAPES = [  # N, K, group: Kimi expert gate+up and down (g32), a dense 8192² layer (g128)
    (4096, 7168, 32),
    (7168, 2048, 32),
    (8192, 8192, 128),
]


@pytest.mark.gpu
def test_quantize_rows_gpu_bytes_match_torch() -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(2049, 7168, generator=gen, device="cuda", dtype=torch.bfloat16) * 3
    q, s = quantize_fp8_rows(x, pad_to=16)
    rq, rs = quantize_fp8_rows_ref(x)
    assert torch.equal(s[:2049], rs)
    assert torch.equal(q[:2049].view(torch.uint8), rq.view(torch.uint8))
    assert not q[2049:].float().any()


@pytest.mark.gpu
@pytest.mark.parametrize(("N", "K", "group"), SHAPES)
@pytest.mark.parametrize("M", [2048, 2049])
def test_w4a8_gemm_gpu(M: int, N: int, K: int, group: int) -> None:
    """Poisoned output; against the fp32 reference on the same codes (bf16 output rounding only) and
    against the W4A16 kernel (the FP8 activation bound derived in the module docstring)."""
    from kernels.w4a16_gemm import w4a16_gemm

    gen = torch.Generator(device="cuda").manual_seed(M + N)
    packed, scale, _ = checkpoint(N, K, group, gen, "cuda")
    x = torch.randn(M, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
    w4a8_gemm(x, packed, scale, group, out=out)
    assert not out.isnan().any()
    xq, xs = quantize_fp8_rows(x)
    assert rel_err(out, w4a8_gemm_ref(xq, xs, packed, scale)) < 2 * BF16_OUT
    w16 = w4a16_gemm(x, packed, scale, group)
    err = rel_err(out, w16)
    assert err < U + 2 * BF16_OUT, err


@pytest.mark.gpu
@pytest.mark.parametrize(("N", "K", "group"), SHAPES)
def test_w4a8_expand_gpu(N: int, K: int, group: int) -> None:
    """Expansion bytes against torch; the product against the same expanded weights (bf16 output
    rounding) and against W4A16 (activation and weight re-rounding: √2 · u)."""
    from kernels.w4a16_gemm import w4a16_gemm

    gen = torch.Generator(device="cuda").manual_seed(N)
    packed, scale, _ = checkpoint(N, K, group, gen, "cuda")
    w8, c = expand_int4_fp8(packed, scale, group)
    r8, rc = expand_int4_fp8_ref(packed, scale)
    assert torch.equal(w8.view(torch.uint8), r8.view(torch.uint8)) and torch.equal(c, rc)
    M = 2049
    x = torch.randn(M, K, generator=gen, device="cuda", dtype=torch.bfloat16)
    out = w4a8_expand_gemm(x, packed, scale, group)
    xq, xs = quantize_fp8_rows(x)
    ref = (xq.float() * xs) @ (w8.float() * c[:, None]).t()
    assert rel_err(out, ref) < 2 * BF16_OUT
    err = rel_err(out, w4a16_gemm(x, packed, scale, group))
    assert err < math.sqrt(2) * U + 2 * BF16_OUT, err


@pytest.mark.gpu
def test_int4_linear_prefill_paths_gpu() -> None:
    """`Int4Linear` on CUDA: W4A16 (the default: `int4_linear`, at these M one dequantizing pass and
    cuBLAS, then the bias) below the threshold and by default; the chosen FP8 path, bias added, from
    `prefill_min_tokens` up."""
    from backend.quant.linear import Int4Linear, set_int4_prefill

    gen = torch.Generator(device="cuda").manual_seed(5)
    w = torch.randn(1024, 2048, generator=gen, device="cuda") * 0.02
    bias = torch.randn(1024, generator=gen, device="cuda").to(torch.bfloat16)
    layer = Int4Linear.from_weight(w.cpu(), bias.cpu(), group_size=32).cuda()
    x = torch.randn(1100, 2048, generator=gen, device="cuda", dtype=torch.bfloat16)
    dense = torch.nn.functional.linear(x, layer.dequantized_weight(x.dtype)) + layer.bias
    assert torch.equal(layer(x), dense)
    assert set_int4_prefill(layer, "w4a8", min_tokens=1024) == 1
    below = torch.nn.functional.linear(x[:1000], layer.dequantized_weight(x.dtype)) + layer.bias
    assert torch.equal(layer(x[:1000]), below)  # below the threshold: W4A16
    fp8 = w4a8_gemm(x, layer.weight_packed, layer.weight_scale, 32) + layer.bias
    assert torch.equal(layer(x), fp8)
    set_int4_prefill(layer, "expand-fp8")
    expand = w4a8_expand_gemm(x, layer.weight_packed, layer.weight_scale, 32) + layer.bias
    assert torch.equal(layer(x), expand)

"""INT4 prefill by expansion: INT4 weights -> per-channel FP8 in a scratch buffer, then `torch._scaled_mm`.

The simple alternative to `kernels/w4a8_gemm.py` ("weights expanded before the matmuls"): one
memory-bound pass writes `[N, K]` e4m3 weights (N·K/2 bytes read, N·K written), activations are
quantized per token (`quantize_fp8_rows`), and cuBLASLt does an FP8 GEMM with a row scale on x and
a column scale on w.

`_scaled_mm` takes one scale per output channel, not one per K-group, so the expansion re-quantizes:
channel scale `c[n] = max_g s[n, g] / 32`, code `(q - 8) · (s[n, g] · 32 / max_g s[n, g])` rounded to
e4m3. The group with the largest scale stays exact (`(q - 8) · 32` is a multiple of 32 up to 256,
exact in e4m3); the others are rounded to e4m3's 3 mantissa bits (relative error ≤ 2^-4), on top of
the INT4 error. W4A8 keeps the checkpoint's weights exactly; this path does not.
"""

from __future__ import annotations

import torch

from kernels.formats.fp8 import FP8
from kernels.formats.int4 import unpack
from kernels.int4_dequant import int4_dequant_triton
from kernels.w4a8_gemm import quantize_fp8_rows

__all__ = ["expand_int4_fp8", "expand_int4_fp8_ref", "w4a8_expand_gemm"]

EXACT_GROUP_MAX = 32.0  # the largest group's codes are (q - 8) · 32: exact in e4m3
_CHUNK_BYTES = 512 * 2**20  # bounds the FP8 scratch for very wide weights (lm_head)


def _channel_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K/G] -> (channel scale c [N] fp32, inv = 32 / max_g s [N] fp32); c = max_g s / 32 exactly."""
    smax = scales.float().amax(dim=1)  # [N]
    smax = torch.where(smax > 0, smax, torch.ones_like(smax))  # an all-zero row: any positive scale
    return smax / EXACT_GROUP_MAX, EXACT_GROUP_MAX / smax


def expand_int4_fp8(
    w: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, K/G]
    group_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 [N, K], fp32 channel scales [N]) with `w ≈ codes · c[:, None]`: one pass of
    `int4_dequant_triton`'s kernel with the codes re-scaled per row."""
    c, inv = _channel_scales(scales)
    return int4_dequant_triton(w, scales, group_size, FP8, row_inv=inv), c


def expand_int4_fp8_ref(
    weight_packed: torch.Tensor, weight_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch, the kernel's arithmetic in the same order: `q · (s · inv)` in fp32, then e4m3."""
    q = unpack(weight_packed).to(torch.float32)  # [N, K]
    group = q.shape[1] // weight_scale.shape[1]
    c, inv = _channel_scales(weight_scale)
    ratio = weight_scale.float() * inv[:, None]  # [N, K/G]
    return (q * ratio.repeat_interleave(group, dim=1)).to(FP8), c


def w4a8_expand_gemm(
    x: torch.Tensor,  # [..., K] bf16 (fp16 works too; `_scaled_mm` with row scales outputs bf16)
    w: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, K/G]
    group_size: int,
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,  # (e4m3 [Mp, K], fp32 [Mp, 1]), Mp = M up to 16
) -> torch.Tensor:
    """`x @ dequant(w).T` through FP8 weights expanded into scratch and `torch._scaled_mm`; [..., N]."""
    K, N = x.shape[-1], w.shape[0]
    if K % 16 or N % 16:
        raise ValueError(f"torch._scaled_mm needs K and N multiples of 16, got K={K} N={N}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    q, s = xq if xq is not None else quantize_fp8_rows(x2, pad_to=16)  # [Mp, K], [Mp, 1]
    if q.shape[0] % 16 or q.shape[0] < M or s.shape != (q.shape[0], 1):
        raise ValueError(f"xq ({tuple(q.shape)}, {tuple(s.shape)}) must cover [{M}, {K}] in rows of 16")
    rows = max(16, _CHUNK_BYTES // K // 16 * 16)
    if rows >= N:  # one chunk (every weight but the widest): the product is the output, no copy of [M, N]
        w8, c = expand_int4_fp8(w, scales, group_size)  # [N, K], [N]
        y = torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=c[None, :], out_dtype=torch.bfloat16)  # [Mp, N]
        return y[:M].to(x.dtype).reshape(*lead, N)  # rows past M are the padding's
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        w8, c = expand_int4_fp8(w[r0:r1], scales[r0:r1], group_size)  # [n, K], [n]
        y = torch._scaled_mm(q, w8.t(), scale_a=s, scale_b=c[None, :], out_dtype=torch.bfloat16)  # [Mp, n]
        out[:, r0:r1] = y[:M]
    return out.reshape(*lead, N)

"""INT4 weights dequantized in one Triton pass: `(q - 8) · s`, optionally re-scaled per row (which the
FP8 expansion of `kernels/w4a8_expand.py` uses); the W4A16 GEMM's wide-M path runs it too.

Layout (`kernels/formats/int4.py`, whose `dequantize_int4` is the reference): `weight_packed` int32
`[N, K/8]`, nibble j of word i (little-endian) holds `q + 8` of element `k = 8i + j`; `weight_scale`
`[N, K/G]`.
"""

from __future__ import annotations

from typing import Protocol

import torch
import triton
import triton.language as tl

from kernels.triton_lib import MAGIC_2_23, unpack_tile


class DequantTiles(Protocol):
    """The tile sizes the launch takes (`kernels.w4a16_config.W4A16Config` is one)."""

    @property
    def block_n(self) -> int: ...
    @property
    def block_k(self) -> int: ...
    @property
    def num_warps(self) -> int: ...


@triton.jit
def _int4_dequant_kernel(
    w_ptr,  # [N, K/8] int32
    s_ptr,  # [N, K/G]
    inv_ptr,  # [N] fp32 row factors (ROW_SCALED), else unused
    out_ptr,  # [N, K]
    N,
    K,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    stride_on,
    magic_2_23,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    ROW_SCALED: tl.constexpr,
):
    """Dense `(q - 8) · s` tiles, or `(q - 8) · (s · inv[n])` when ROW_SCALED; grid (N/BN, K/BK)."""
    BK8: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    r = tl.program_id(1) * BK8 + tl.arange(0, BK8)
    wp = tl.load(
        w_ptr + offs_n[:, None] * stride_wn + r[None, :] * stride_wk,
        mask=n_ok[:, None] & (r < K // 8)[None, :],
        other=0,
    )  # [BN, BK8]
    g = tl.program_id(1) * BLOCK_K // GROUP_SIZE + tl.arange(0, SCALE_ROWS)
    sc = tl.load(
        s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg,
        mask=n_ok[:, None] & (g < K // GROUP_SIZE)[None, :],
        other=0.0,
    ).to(tl.float32)  # [BN, SR]
    if ROW_SCALED:
        sc = sc * tl.load(inv_ptr + offs_n, mask=n_ok, other=0.0)[:, None]  # one rounding, as the reference
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BLOCK_N, SCALE_ROWS, BK8 // SCALE_ROWS)), (BLOCK_N, BK8))
    offs_k = tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K)
    wf = unpack_tile(wp, sc, magic_2_23, out_ptr.dtype.element_ty)  # [BN, BK]
    tl.store(
        out_ptr + offs_n[:, None] * stride_on + offs_k[None, :],
        wf,
        mask=n_ok[:, None] & (offs_k < K)[None, :],
    )


def int4_dequant_triton(
    w: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, K/G]
    group_size: int,
    dtype: torch.dtype,
    cfg: DequantTiles | None = None,
    row_inv: torch.Tensor | None = None,  # [N] fp32: codes (q - 8) · (s · row_inv) instead (FP8 expansion)
) -> torch.Tensor:
    """`[N, K]` dense weight `(q - 8) · s` in `dtype`, one pass over the packed words."""
    N, K8 = w.shape
    block_n, block_k, num_warps = (cfg.block_n, cfg.block_k, cfg.num_warps) if cfg else (32, 256, 4)
    out = torch.empty((N, 8 * K8), dtype=dtype, device=w.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(8 * K8, block_k))
    _int4_dequant_kernel[grid](
        w,
        scales,
        scales if row_inv is None else row_inv,
        out,
        N,
        8 * K8,
        w.stride(0),
        w.stride(1),
        scales.stride(0),
        scales.stride(1),
        out.stride(0),
        MAGIC_2_23,
        GROUP_SIZE=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SCALE_ROWS=max(block_k // group_size, 1),
        ROW_SCALED=row_inv is not None,
        num_warps=num_warps,
    )
    return out

"""W4A8 GEMM for prefill: `out[M, N] = x[M, K] @ dequant(w)[K, N]` on FP8 tensor cores, INT4 weights.

Weights stay in the checkpoint layout `w4a16_gemm` reads (`weight_packed` int32 `[N, K/8]`, nibble j
of word i holds `q + 8` of `k = 8i + j`; `weight_scale` `[N, K/G]`). Two steps per call:
1. `quantize_fp8_rows`: activations to e4m3 with one fp32 scale per token, `absmax / 448`
   (`_quant_rows_kernel`, one program per row).
2. `_w4a8_kernel`: each nibble becomes `q - 8` in e4m3 in registers (every integer in [-8, 7] is exact
   in e4m3), and the product runs as FP8 × FP8 → fp32 `tl.dot`s of one K-chunk inside one scale
   group each (`CHUNK = min(G, BLOCK_K)`); each chunk's partial sum is multiplied by its group scale
   in fp32 before it is added to the accumulator, so the weights are exactly the checkpoint's and
   the only new error is the activations' FP8 rounding. The epilogue multiplies by the row scale.
   `swap_xw` computes the transposed tile (`w` as the dot's first operand), which lets the
   dequantized weights feed Hopper's wgmma from registers instead of shared memory.

The price of exact group scales: per chunk, one fp32 multiply-add per accumulator element. At
G = 32 that is as many CUDA-core operations as the chunk's tensor-core MACs / 32, the same time as
the MMA itself on an H100/H200 SM (4096 FP8 MAC vs 128 FP32 FMA per clock), so G = 32 cannot reach
FP8 GEMM speed this way; G = 128 costs a quarter of that. `kernels/w4a8_expand.py` is the other
route (weights re-quantized to per-channel FP8 in a scratch buffer, then `torch._scaled_mm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.formats.fp8 import FP8, FP8_MAX
from kernels.formats.int4 import check_int4_operands, dequantize_int4
from kernels.triton_lib import MAGIC_2_23, grouped_tile, unpack_tile

__all__ = [
    "FP8_MAX",
    "W4A8Config",
    "pick_config",
    "quantize_fp8_rows",
    "quantize_fp8_rows_ref",
    "w4a8_gemm",
    "w4a8_gemm_ref",
]

_TINY = 1e-12  # an all-zero row gets this absmax: scale > 0, every code 0


@triton.jit
def _quant_rows_kernel(
    x_ptr,  # [M, K] float
    q_ptr,  # [Mp, K] e4m3, Mp >= M: rows past M are written as zeros (scaled_mm's padding)
    s_ptr,  # [Mp] fp32
    M,
    K,
    stride_xm,
    stride_qm,
    BLOCK_K: tl.constexpr,
):
    """One row per program: absmax over the row, then `x / (absmax / 448)` rounded to e4m3."""
    row = tl.program_id(0)
    live = row < M
    offs = tl.arange(0, BLOCK_K)
    amax = tl.zeros((BLOCK_K,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=live & (k0 + offs < K), other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    scale = tl.math.div_rn(tl.maximum(tl.max(amax, axis=0), 1e-12), 448.0)  # IEEE, as torch's `/`
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_ptr + row * stride_xm + k0 + offs, mask=live & (k0 + offs < K), other=0.0)
        q = tl.math.div_rn(x.to(tl.float32), scale)  # not `/`: Triton lowers that to div.full.f32
        tl.store(q_ptr + row * stride_qm + k0 + offs, q.to(q_ptr.dtype.element_ty), mask=k0 + offs < K)
    tl.store(s_ptr + row, scale)


def quantize_fp8_rows(x: torch.Tensor, pad_to: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (e4m3 [Mp, K], fp32 scales [Mp, 1]) with `x ≈ q · s`; Mp is M rounded up
    to `pad_to`, the padding rows zero (`torch._scaled_mm` wants 16)."""
    if x.dim() != 2 or not x.is_floating_point():
        raise TypeError(f"x must be a 2-D float tensor, got {x.dtype} {tuple(x.shape)}")
    M, K = x.shape
    Mp = -(-M // pad_to) * pad_to
    q = torch.empty((Mp, K), dtype=FP8, device=x.device)
    s = torch.empty((Mp, 1), dtype=torch.float32, device=x.device)
    if Mp:
        block_k = min(2048, triton.next_power_of_2(max(K, 16)))
        _quant_rows_kernel[(Mp,)](
            x, q, s, M, K, x.stride(0), q.stride(0), BLOCK_K=block_k, num_warps=4 if block_k <= 1024 else 8
        )
    return q, s


def quantize_fp8_rows_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure torch: (e4m3 [M, K], fp32 [M, 1]), the same formula as the kernel."""
    amax = x.float().abs().amax(dim=1, keepdim=True).clamp_min(_TINY)
    # a tensor divisor: torch's CUDA `/` by a Python scalar multiplies by its reciprocal (1 ulp off IEEE
    # division in some rows, the H200 run of 2026-12-02); element-wise division rounds as the kernel does
    scale = amax / torch.full_like(amax, FP8_MAX)
    return (x.float() / scale).to(FP8), scale


@triton.jit
def _w4a8_kernel(
    xq_ptr,  # [M, K] e4m3 (or any dot dtype)
    xs_ptr,  # [M] fp32 row scales
    w_ptr,  # [N, K/8] int32
    s_ptr,  # [N, K/G] group scales
    out_ptr,  # [M, N]
    M,
    N,
    K,
    K8,  # K / 8 and K / G as arguments: divisibility specialisation gives wide masked loads
    KG,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sg,
    stride_om,
    stride_on,
    magic_2_23,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CHUNK: tl.constexpr,  # K per dot, min(G, BLOCK_K): one group scale per chunk
    GROUP_M: tl.constexpr,
    SWAP_XW: tl.constexpr,
):
    """Grid (tiles of M×N,); each program walks K in BLOCK_K tiles of BLOCK_K / CHUNK dots."""
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    C8: tl.constexpr = CHUNK // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_c = tl.arange(0, CHUNK)
    offs_r = tl.arange(0, C8)
    if SWAP_XW:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)  # out tile transposed
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        for c in tl.static_range(BLOCK_K // CHUNK):
            kc = k0 + c * CHUNK
            kk = kc + offs_c  # [C]
            x = tl.load(
                xq_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
                mask=m_ok[:, None] & (kk < K)[None, :],
                other=0.0,
            )  # [BM, C]
            r = kc // 8 + offs_r  # [C8]
            wp = tl.load(
                w_ptr + offs_n[:, None] * stride_wn + r[None, :] * stride_wk,
                mask=n_ok[:, None] & (r < K8)[None, :],
                other=0,
            )  # [BN, C8] int32
            g = kc // GROUP_SIZE
            sc = tl.load(s_ptr + offs_n * stride_sn + g * stride_sg, mask=n_ok & (g < KG), other=0.0)
            sc = sc.to(tl.float32)  # [BN]
            w = unpack_tile(wp, 1.0, magic_2_23, xq_ptr.dtype.element_ty)  # [BN, C] q - 8, exact
            if SWAP_XW:
                acc += tl.dot(w, tl.trans(x)) * sc[:, None]  # [BN, BM]
            else:
                acc += tl.dot(x, tl.trans(w)) * sc[None, :]  # [BM, BN]
    if SWAP_XW:
        acc = tl.trans(acc)
    xs = tl.load(xs_ptr + offs_m, mask=m_ok, other=0.0)  # [BM]
    out = acc * xs[:, None]
    tl.store(
        out_ptr + offs_m[:, None] * stride_om + offs_n[None, :] * stride_on,
        out.to(out_ptr.dtype.element_ty),
        mask=m_ok[:, None] & n_ok[None, :],
    )


@dataclass(frozen=True, slots=True)
class W4A8Config:
    """Tile shape and launch parameters of `_w4a8_kernel`."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    swap_xw: bool = True
    maxnreg: int | None = None  # 128 lets two 8-warp programs share an SM (64-token tiles fit it)


def pick_config(M: int, N: int, K: int) -> W4A8Config:
    """Prefill tiles (M in the thousands); untuned until the H200 sweep in bench_w4a8 says otherwise."""
    del N, K
    return W4A8Config(block_m=128 if M >= 128 else 64)


def w4a8_gemm(
    x: torch.Tensor,  # [..., K] bf16 / fp16 / fp32
    w: torch.Tensor,  # [N, K/8] int32 (repack_int4's output: the checkpoint layout)
    scales: torch.Tensor,  # [N, K/G] float
    group_size: int,
    config: W4A8Config | None = None,
    out: torch.Tensor | None = None,  # [M, N] contiguous, x's dtype (poisoned-buffer tests, graphs)
    xq: tuple[torch.Tensor, torch.Tensor] | None = None,  # (e4m3 [M', K], fp32 [M', 1]) M' >= M
) -> torch.Tensor:
    """`x @ dequant(w).T` with x quantized per token to e4m3 (or `xq`, already quantized); [..., N]."""
    if group_size < 32 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two >= 32 (FP8 dots take K >= 32), got {group_size}")
    check_int4_operands(x, w, scales, group_size)
    K, N = x.shape[-1], w.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} [{M}, {N}]")
    if M == 0:
        return out.reshape(*lead, N)
    q, s = xq if xq is not None else quantize_fp8_rows(x2)
    if q.shape[0] < M or q.shape[1] != K or s.shape[0] < M:
        raise ValueError(f"xq ({tuple(q.shape)}, {tuple(s.shape)}) does not cover x [{M}, {K}]")
    cfg = config or pick_config(M, N, K)
    if cfg.block_k % min(group_size, cfg.block_k):
        raise ValueError(f"block_k {cfg.block_k} and group {group_size} do not tile")
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _w4a8_kernel[grid](
        q,
        s,
        w,
        scales,
        out,
        M,
        N,
        K,
        K // 8,
        K // group_size,
        *q.stride(),
        *w.stride(),
        *scales.stride(),
        *out.stride(),
        MAGIC_2_23,
        GROUP_SIZE=group_size,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        CHUNK=min(group_size, cfg.block_k),
        GROUP_M=cfg.group_m,
        SWAP_XW=cfg.swap_xw,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return out.reshape(*lead, N)


def w4a8_gemm_ref(
    xq: torch.Tensor,  # [M, K] e4m3
    xs: torch.Tensor,  # [M, 1] fp32
    weight_packed: torch.Tensor,  # [N, K/8] int32, checkpoint layout
    weight_scale: torch.Tensor,  # [N, K/G]
) -> torch.Tensor:
    """Pure torch, fp32 [M, N]: dequantize with group scales, activations from their FP8 codes."""
    K = 8 * weight_packed.shape[1]
    w = dequantize_int4(weight_packed, weight_scale, K, K // weight_scale.shape[1], torch.float32)  # [N, K]
    return (xq.to(torch.float32) * xs) @ w.t()

"""Weight-only FP8 GEMV/GEMM: `out[M, N] = x[M, K] @ dequant(w)[K, N]` with e4m3 weights, per-channel
or block scales, activations in their own dtype (bf16 / fp16 / fp32) and fp32 accumulation.

The weight format is `kernels/formats/fp8.py`'s: `w` float8_e4m3fn `[N, K]` and an fp32 multiplier,
`[N, 1]` per channel or `[ceil(N/Sn), ceil(K/Sk)]` per block (DeepSeek's 128×128). Activations are
never quantized, so the numerics are those of dequantize-then-matmul (what `Fp8Linear` ran before),
not `torch._scaled_mm`'s (which rounds the activations to FP8 too).

Two kernels, for the decode sizes a step hands a Linear (`kernels/fp8_linear.py` sends larger M to
dequantize + cuBLAS, where the dequantization is amortised over the rows):
- `_fp8_gemv_kernel` (M of 1-2): no tensor cores; each program reads a `[BN, BK]` tile of bytes
  (16-byte loads along K), converts and multiplies on the CUDA cores and reduces once at the end.
  A block's scale is one number per (row block, K tile) when BN and BK divide the block, so it
  scales the [BK] activations instead of the [BN, BK] weights; per-channel scales multiply the
  row sums at the end.
- `_fp8_tile_kernel` (M 3-64): tiles dequantized to the activation dtype in registers exactly as
  `dequantize_fp8` rounds them (`(q · s)` in fp32, then the cast), then `tl.dot`.
Both split K across programs when there are too few output tiles to fill the GPU: partial sums go
to an fp32 workspace and the last program of a tile adds them in a fixed order (`split_k_finish`).
Under PDL (`kernels/triton_lib.py`) the GEMV asks L2 for its first weight tile before the wait, and
the tiles load their per-channel scales there.

Shape letters: M rows, N out features, K in features, Sn/Sk the scale block (1 / K: per channel).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from kernels.formats.fp8 import FP8
from kernels.split_k_merge import num_sms, split_k_counters
from kernels.triton_lib import pdl_args, pdl_launch_dependents, pdl_wait, prefetch_l2, split_k_finish

__all__ = ["Fp8GemmConfig", "fp8_gemm", "pick_config"]


@triton.jit
def _fp8_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    SCALE_BN: tl.constexpr,  # rows per scale (1: per channel)
    SCALE_BK: tl.constexpr,  # K per scale (0: per channel, one scale per row)
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: the first weight tile goes to L2 before the wait
):
    """x [M, K], w [N, K] e4m3, s per channel [N, 1] or per block [N/Sn, K/Sk], out [M, N];
    grid (N/BN, M, splits of K). Blocks: BN divides Sn and BK divides Sk."""
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, tl.num_programs(2))
    t0 = pid_k * per_split
    t1 = tl.minimum(t0 + per_split, k_tiles)
    if PDL:  # the first K tile's rows (BK bytes each, 128 a line) on their way to L2: constant (rule 2)
        LINES: tl.constexpr = (BLOCK_K + 127) // 128
        lines = t0 * BLOCK_K + tl.arange(0, LINES) * 128
        ok = n_ok[:, None] & (lines < K)[None, :] & (t0 < t1)
        prefetch_l2(w_ptr + offs_n[:, None] * stride_wn + lines[None, :] * stride_wk, ok)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for t in range(t0, t1):
        kk = t * BLOCK_K + offs_k
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk
        x_ptrs = x_ptr + pid_m * stride_xm + kk * stride_xk
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)  # [BK]
            w = tl.load(w_ptrs, mask=n_ok[:, None], other=0.0)  # [BN, BK] e4m3
        else:
            x = tl.load(x_ptrs, mask=kk < K, other=0.0).to(tl.float32)
            w = tl.load(w_ptrs, mask=n_ok[:, None] & (kk < K)[None, :], other=0.0)
        if SCALE_BK > 0:  # one block scale for the whole tile: it scales the activations
            sc = tl.load(
                s_ptr + (pid_n * BLOCK_N // SCALE_BN) * stride_sn + (t * BLOCK_K // SCALE_BK) * stride_sk
            )
            x = x * sc
        acc += w.to(tl.float32) * x[None, :]
    acc_n = tl.sum(acc, axis=1)  # [BN]
    if SCALE_BK == 0:
        acc_n = acc_n * tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)
    split_k_finish(
        acc_n[None, :], out_ptr, ws_ptr, cnt_ptr, pid_m + tl.arange(0, 1), offs_n, M, N, stride_om, stride_on,
        pid_m * tl.num_programs(0) + pid_n, pid_k, tl.num_programs(2),
    )  # fmt: skip


@triton.jit
def _fp8_tile_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    stride_wn,
    stride_wk,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,  # 0: per channel
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: per-channel scales load before the wait
):
    """x [M, K], w [N, K] e4m3, scales as the GEMV's, out [M, N]; grid (N/BN, M/BM, SPLIT_K)."""
    pdl_launch_dependents(PDL)
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t0 = pid_k * per_split
    if SCALE_BK == 0:
        row_scale = tl.load(s_ptr + offs_n * stride_sn, mask=n_ok, other=0.0)  # [BN], constant (rule 2)
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t0, tl.minimum(t0 + per_split, k_tiles)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < K
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=m_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BM, BK]
        w = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + kk[None, :] * stride_wk,
            mask=n_ok[:, None] & k_ok[None, :],
            other=0.0,
        ).to(tl.float32)  # [BN, BK]
        if SCALE_BK == 0:
            w = w * row_scale[:, None]
        else:
            w = w * tl.load(
                s_ptr + (pid_n * BLOCK_N // SCALE_BN) * stride_sn + (t * BLOCK_K // SCALE_BK) * stride_sk
            )
        acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    split_k_finish(
        acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on,
        pid_m * tl.num_programs(0) + pid_n, pid_k, SPLIT_K,
    )  # fmt: skip


@dataclass(frozen=True, slots=True)
class Fp8GemmConfig:
    """Tile shape and launch parameters; `block_m == 0` selects the GEMV kernel."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3


# Launcher defaults (not yet tuned on the H200): BN and BK divide 128, so a 128×128 block's scale is
# one number per tile; the GEMV's K split aims at GEMV_PROGRAMS_PER_SM programs per SM.
GEMV_DEFAULT = Fp8GemmConfig(block_m=0, block_n=64, block_k=128, num_warps=4)
GEMV_PROGRAMS_PER_SM = 8
GEMV_MAX_M = 2  # the GEMV reads the weights once per row
TILE_DEFAULTS = (
    (16, Fp8GemmConfig(block_m=16, block_n=64, block_k=128, num_stages=4)),
    (32, Fp8GemmConfig(block_m=32, block_n=64, block_k=128, num_stages=4)),
    (64, Fp8GemmConfig(block_m=64, block_n=64, block_k=128, num_stages=4)),
)
MAX_M = TILE_DEFAULTS[-1][0]  # beyond: dequantize + cuBLAS (`kernels/fp8_linear.py`)


def pick_config(M: int, N: int, K: int, num_sms: int) -> Fp8GemmConfig:
    """The GEMV up to GEMV_MAX_M rows, else the first tiles whose bound holds, K split to fill the GPU."""
    if M <= GEMV_MAX_M:
        cfg, rows, target = GEMV_DEFAULT, M, GEMV_PROGRAMS_PER_SM * num_sms
    else:
        cfg = next((c for bound, c in TILE_DEFAULTS if bound >= M), TILE_DEFAULTS[-1][1])
        rows, target = triton.cdiv(M, cfg.block_m), 4 * num_sms
    tiles = triton.cdiv(N, cfg.block_n) * rows
    k_tiles = triton.cdiv(K, cfg.block_k)
    split = max(1, min(k_tiles // 2, round(target / tiles), 16))
    return replace(cfg, split_k=triton.cdiv(k_tiles, triton.cdiv(k_tiles, split)))  # every split with work


def fp8_gemm(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    w: torch.Tensor,  # [N, K] float8_e4m3fn
    scale: torch.Tensor,  # fp32 [N, 1] (block None) or [ceil(N/Sn), ceil(K/Sk)]
    block: tuple[int, int] | None,
    config: Fp8GemmConfig | None = None,
) -> torch.Tensor:
    """`x @ dequant(w).T` in x's dtype, fp32 accumulation; [..., N]."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"activations must be fp16, bf16 or fp32, got {x.dtype}")
    if w.dtype != FP8 or w.dim() != 2 or scale.dtype != torch.float32 or scale.dim() != 2:
        raise TypeError(f"w must be 2-D {FP8} and scale 2-D float32, got {w.dtype}, {scale.dtype}")
    N, K = w.shape
    if x.shape[-1] != K or not (x.device == w.device == scale.device):
        raise ValueError(f"x {tuple(x.shape)} does not fit w {tuple(w.shape)} on one device")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    cfg = config or pick_config(M, N, K, num_sms(x.device))
    if block is None:
        if tuple(scale.shape) != (N, 1):
            raise ValueError(f"per-channel scale must be [{N}, 1], got {tuple(scale.shape)}")
        scale_bn, scale_bk = 1, 0
    else:
        scale_bn, scale_bk = block
        if tuple(scale.shape) != (triton.cdiv(N, scale_bn), triton.cdiv(K, scale_bk)):
            raise ValueError(f"block scale {tuple(scale.shape)} does not fit w {(N, K)} in {block} blocks")
        if scale_bn % cfg.block_n or scale_bk % cfg.block_k:
            raise ValueError(f"tiles {cfg} must divide the scale block {block}")
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return out.reshape(*lead, N)
    rows = M if cfg.block_m == 0 else triton.cdiv(M, cfg.block_m)
    grid = (triton.cdiv(N, cfg.block_n), rows, cfg.split_k)
    ws = torch.empty((cfg.split_k, M, N) if cfg.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    cnt = split_k_counters(x.device, grid[0] * grid[1])
    args = (x2, w, scale, out, ws, cnt, M, N, K, *x2.stride(), *w.stride(), *scale.stride(), *out.stride())
    if cfg.block_m == 0:
        _fp8_gemv_kernel[grid](
            *args, SCALE_BN=scale_bn, SCALE_BK=scale_bk, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=K % cfg.block_k == 0, **pdl_args(x.device), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip
    else:
        _fp8_tile_kernel[grid](
            *args, SCALE_BN=scale_bn, SCALE_BK=scale_bk, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k, SPLIT_K=cfg.split_k, DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            **pdl_args(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip
    return out.reshape(*lead, N)

"""W4A16 GEMM/GEMV: `out[M, N] = x[M, K] @ dequant(w)[K, N]` with INT4 weights and group scales.

Checkpoint layout (compressed-tensors pack-quantized, symmetric): `weight_packed` int32 `[N, K/8]`,
nibble j of word i (little-endian) holds `q + 8` of element `k = 8i + j`; `weight_scale` `[N, K/G]`.
The kernels read that layout as it is (see `repack_int4` for why): each thread loads 16 bytes of
consecutive words along K and unpacks them into eight consecutive k per word.

`w4a16_gemm` picks by M (`kernels/w4a16_config.py`'s `pick_config`):
- decode (M of 1-2, G >= 32): the GEMV on the CUDA cores, `kernels/w4a16_gemv.py`;
- `_w4a16_kernel` (M 3-64): tiles dequantized to the activation dtype in registers, then `tl.dot`
  (`swap_xw`: the transposed product, the dequantized tile as wgmma's register operand);
- prefill (M > 64): `dequantize_int4` once, then cuBLAS (twice as fast as the fused tiles on H200).
The GEMV and the tiles split K across programs when there are too few output tiles to fill the GPU; partial sums go to
an fp32 workspace and the last program of each tile (an atomic counter that resets itself) adds them
in a fixed order, so results are deterministic.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats.int4 import check_int4_operands, dequantize_int4
from kernels.int4_dequant import int4_dequant_triton
from kernels.split_k_merge import num_sms, split_k_counters
from kernels.triton_lib import MAGIC_2_23, grouped_tile, pdl_args, pdl_enter, split_k_finish, unpack_tile
from kernels.w4a16_config import W4A16Config, pick_config
from kernels.w4a16_gemv import w4a16_gemv

__all__ = ["w4a16_gemm", "w4a16_gemm_ref"]


@triton.jit
def _w4a16_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K,
    K8,  # K / 8 and K / G: see `kernels/w4a16_gemv.py`'s _w4a16_gemv_kernel
    KG,
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_sg,
    stride_sn,
    stride_om,
    stride_on,
    magic_2_23,  # 0x4B000000, run-time for the same reason as magic_one
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SWAP_XW: tl.constexpr,  # the transposed tile: the dequantized weights are the dot's first operand
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    """x [M, K], w [N, K/8] int32, s [N, K/G], out [M, N]; grid (tiles of M×N, SPLIT_K)."""
    pdl_enter(PDL)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    BK8: tl.constexpr = BLOCK_K // 8
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BK8)
    offs_g = tl.arange(0, SCALE_ROWS)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, SPLIT_K)
    t0 = pid_k * per_split
    t1 = tl.minimum(t0 + per_split, k_tiles)
    if SWAP_XW:  # wgmma takes its first operand from registers: no shared-memory pass for w
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(t0, t1):
        kk = t * BLOCK_K + offs_k
        x = tl.load(
            x_ptr + offs_m[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=m_ok[:, None] & (kk < K)[None, :],
            other=0.0,
        )  # [BM, BK]
        r = t * BK8 + offs_r
        wp = tl.load(
            w_ptr + offs_n[:, None] * stride_wn + r[None, :] * stride_wk,
            mask=n_ok[:, None] & (r < K8)[None, :],
            other=0,
        )  # [BN, BK8] int32
        g = t * BLOCK_K // GROUP_SIZE + offs_g
        sc = tl.load(
            s_ptr + offs_n[:, None] * stride_sn + g[None, :] * stride_sg,
            mask=n_ok[:, None] & (g < KG)[None, :],
            other=0.0,
        ).to(tl.float32)  # [BN, SR]
        sc = tl.reshape(
            tl.broadcast_to(sc[:, :, None], (BLOCK_N, SCALE_ROWS, BK8 // SCALE_ROWS)), (BLOCK_N, BK8)
        )  # [BN, BK8] scale of each packed word
        w = unpack_tile(wp, sc, magic_2_23, x.dtype)  # [BN, BK]
        if SWAP_XW:
            acc = tl.dot(w, tl.trans(x), acc, input_precision=DOT_PRECISION)  # [BN, BM]
        else:
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)  # [BM, BN]
    if SWAP_XW:
        acc = tl.trans(acc)
    tile_id = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
    split_k_finish(
        acc, out_ptr, ws_ptr, cnt_ptr, offs_m, offs_n, M, N, stride_om, stride_on, tile_id, pid_k, SPLIT_K
    )


def w4a16_gemm(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    w_repacked: torch.Tensor,  # [N, K/8] int32 from repack_int4
    scales: torch.Tensor,  # [N, K/G] float
    group_size: int,
    config: W4A16Config | None = None,
    out: torch.Tensor | None = None,  # [M, N] contiguous, out_dtype: for preallocated (graph) buffers
    out_dtype: torch.dtype | None = None,  # None: x's; float32 for a narrower x: widened exactly
) -> torch.Tensor:
    """`x @ dequant(w)` in `out_dtype` (x's by default); [..., N]. A float32 product of a bf16 / fp16 x
    is `x.float() @ dequant(w)` to the bit: the GEMV widens each x as it loads it (every path reads x
    into float32), the tiles and prefill, whose operands are x's dtype, read the widened copy."""
    if group_size % 8 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two and a multiple of 8, got {group_size}")
    check_int4_operands(x, w_repacked, scales, group_size)
    dtype = out_dtype or x.dtype
    if dtype != x.dtype and dtype != torch.float32:
        raise ValueError(f"out_dtype must be x's dtype ({x.dtype}) or float32, got {dtype}")
    K, N = x.shape[-1], w_repacked.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {dtype} [{M}, {N}]")
    if M == 0:
        return out.reshape(*lead, N)
    cfg = config or pick_config(M, N, K, num_sms(x.device), group_size)
    if dtype != x.dtype and (cfg.dense or cfg.block_m > 0):  # operands in x's dtype: widen it first
        x2 = x2.to(dtype)
    ws = torch.empty((cfg.split_k, M, N) if cfg.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    if cfg.dense:  # prefill
        _dense_product(x2, w_repacked, scales, group_size, cfg, out)
    elif cfg.block_m == 0:  # decode
        w4a16_gemv(x2, w_repacked, scales, group_size, cfg, out, ws)
    else:
        strides = (
            *x2.stride(),
            w_repacked.stride(1),
            w_repacked.stride(0),
            scales.stride(1),
            scales.stride(0),
            *out.stride(),
        )
        num_tiles = triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n)
        cnt = split_k_counters(x.device, num_tiles)
        _w4a16_kernel[(num_tiles, cfg.split_k)](
            x2,
            w_repacked,
            scales,
            out,
            ws,
            cnt,
            M,
            N,
            K,
            K // 8,
            K // group_size,
            *strides,
            MAGIC_2_23,
            GROUP_SIZE=group_size,
            BLOCK_M=cfg.block_m,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            SPLIT_K=cfg.split_k,
            GROUP_M=cfg.group_m,
            SCALE_ROWS=max(cfg.block_k // group_size, 1),
            DOT_PRECISION="ieee" if x2.dtype == torch.float32 else "tf32",
            SWAP_XW=cfg.swap_xw,
            **pdl_args(x.device),
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out.reshape(*lead, N)


_DENSE_CHUNK_BYTES = 512 * 2**20  # bounds the dequantized scratch for very wide weights (lm_head)


def _dense_product(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, K/G]
    group_size: int,
    cfg: W4A16Config,
    out: torch.Tensor,  # [M, N]
) -> None:
    """Prefill: dequantize rows of the weight into scratch, multiply with cuBLAS, chunk by chunk."""
    N, K = w.shape[0], x.shape[1]
    rows = max(cfg.block_n, _DENSE_CHUNK_BYTES // (K * x.element_size()) // cfg.block_n * cfg.block_n)
    if rows >= N:
        torch.matmul(x, int4_dequant_triton(w, scales, group_size, x.dtype, cfg).t(), out=out)
        return
    for r0 in range(0, N, rows):
        r1 = min(N, r0 + rows)
        out[:, r0:r1] = x @ int4_dequant_triton(w[r0:r1], scales[r0:r1], group_size, x.dtype, cfg).t()


def w4a16_gemm_ref(
    x: torch.Tensor,  # [..., K]
    weight_packed: torch.Tensor,  # [N, K/8] int32, checkpoint layout
    weight_scale: torch.Tensor,  # [N, K/G]
) -> torch.Tensor:
    """Pure-torch reference on the checkpoint layout: dequantize in fp32, matmul in fp32."""
    K = 8 * weight_packed.shape[1]
    w = dequantize_int4(weight_packed, weight_scale, K, K // weight_scale.shape[1], torch.float32)  # [N, K]
    return (x.to(torch.float32) @ w.t()).to(x.dtype)

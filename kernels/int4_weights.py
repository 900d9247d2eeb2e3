"""INT4 weights (compressed-tensors pack-quantized) for the W4A16 / W4A8 kernels: layout check at
load, operand checks, dequantization in one Triton pass (optionally re-scaled per row, which the FP8
expansion uses), the Triton helpers that unpack words and order tiles, and the pure-torch unpack.

Layout: `weight_packed` int32 `[N, K/8]`, nibble j of word i (little-endian) holds `q + 8` of element
`k = 8i + j`; `weight_scale` `[N, K/G]`; the weight is `(q) · s` with q in [-8, 7].
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

if TYPE_CHECKING:
    from kernels.w4a16_gemm import W4A16Config

_MAGIC_2_23 = 0x4B000000  # bits of 2^23: OR a nibble into the low mantissa bits to get 2^23 + nibble


@triton.jit
def _nibble(wp, sc, magic_2_23, J: tl.constexpr, DTYPE: tl.constexpr):
    """Nibble J of every word, `(q - 8) · s` in DTYPE: SHF, LOP3 (AND+OR), FADD, FMUL, convert."""
    q = (wp >> (4 * J)) & 0xF
    return (((q | magic_2_23).to(tl.float32, bitcast=True) - 8388616.0) * sc).to(DTYPE)


@triton.jit
def _unpack_tile(wp, sc, magic_2_23, DTYPE: tl.constexpr):
    """[BN, BK8] words and per-word scales -> [BN, 8·BK8] weights, k = 8r + j.

    Each nibble plane uses compile-time shifts; the interleave tree puts the eight k of a word side
    by side in one thread (16-byte shared-memory stores of the K-major tensor-core operand).
    """
    e0 = tl.interleave(
        tl.interleave(_nibble(wp, sc, magic_2_23, 0, DTYPE), _nibble(wp, sc, magic_2_23, 4, DTYPE)),
        tl.interleave(_nibble(wp, sc, magic_2_23, 2, DTYPE), _nibble(wp, sc, magic_2_23, 6, DTYPE)),
    )  # even k
    e1 = tl.interleave(
        tl.interleave(_nibble(wp, sc, magic_2_23, 1, DTYPE), _nibble(wp, sc, magic_2_23, 5, DTYPE)),
        tl.interleave(_nibble(wp, sc, magic_2_23, 3, DTYPE), _nibble(wp, sc, magic_2_23, 7, DTYPE)),
    )  # odd k
    return tl.interleave(e0, e1)


@triton.jit
def _grouped_tile(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of program `pid` in grouped order: GROUP_M row-tiles walk N together, so their
    weight tiles are reused from L2."""
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_id = pid // (GROUP_M * num_pid_n)
    first_m = group_id * GROUP_M
    group_rows = tl.minimum(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * num_pid_n)) % group_rows
    pid_n = (pid % (GROUP_M * num_pid_n)) // group_rows
    return pid_m, pid_n


@triton.jit
def _dequant_kernel(
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
    wf = _unpack_tile(wp, sc, magic_2_23, out_ptr.dtype.element_ty)  # [BN, BK]
    tl.store(
        out_ptr + offs_n[:, None] * stride_on + offs_k[None, :],
        wf,
        mask=n_ok[:, None] & (offs_k < K)[None, :],
    )


def dequantize_int4(
    w: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, K/G]
    group_size: int,
    dtype: torch.dtype,
    cfg: W4A16Config | None = None,
    row_inv: torch.Tensor | None = None,  # [N] fp32: codes (q - 8) · (s · row_inv) instead (FP8 expansion)
) -> torch.Tensor:
    """`[N, K]` dense weight `(q - 8) · s` in `dtype`, one pass over the packed words."""
    N, K8 = w.shape
    block_n, block_k, num_warps = (cfg.block_n, cfg.block_k, cfg.num_warps) if cfg else (32, 256, 4)
    out = torch.empty((N, 8 * K8), dtype=dtype, device=w.device)
    grid = (triton.cdiv(N, block_n), triton.cdiv(8 * K8, block_k))
    _dequant_kernel[grid](
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
        _MAGIC_2_23,
        GROUP_SIZE=group_size,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SCALE_ROWS=max(block_k // group_size, 1),
        ROW_SCALED=row_inv is not None,
        num_warps=num_warps,
    )
    return out


def check_int4_operands(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """The GEMM launchers' checks: x [..., K] fp16/bf16/fp32, w [N, K/8] int32, scales [N, K/G]."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"activations must be fp16, bf16 or fp32, got {x.dtype}")
    if w.dtype != torch.int32 or w.dim() != 2:
        raise TypeError(f"w_repacked must be 2-D int32 [N, K/8], got {w.dtype} {tuple(w.shape)}")
    if not scales.is_floating_point() or scales.dim() != 2:
        raise TypeError("scales must be a 2-D float tensor [N, K/G]")
    K, N = x.shape[-1], w.shape[0]
    if w.shape[1] * 8 != K or K % group_size:
        raise ValueError(f"K={K} does not match w_repacked {tuple(w.shape)} and group {group_size}")
    if tuple(scales.shape) != (N, K // group_size):
        raise ValueError(f"scales {tuple(scales.shape)} != ({N}, {K // group_size})")
    if not (x.device == w.device == scales.device):
        raise ValueError("x, w_repacked and scales must be on one device")


def repack_int4(
    weight_packed: torch.Tensor,  # [N, K/8] int32, checkpoint layout
    weight_scale: torch.Tensor,  # [N, K/G]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checkpoint tensors -> what the kernels take, once at load: `(w [N, K/8] int32, scales [N, K/G], G)`.

    The kernels read the checkpoint layout itself: K-contiguous words give each thread 16-byte loads
    and, unpacked, eight consecutive k, which is the K-major B operand the tensor cores want (a
    transposed `[K/8, N]` layout measured slower: 2-byte shared-memory stores of the dequantized
    tile). So the repack validates, infers the group size and makes both tensors contiguous.
    """
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise TypeError("weight_packed must be 2-D int32 [N, K/8]")
    N, K8 = weight_packed.shape
    if weight_scale.dim() != 2 or weight_scale.shape[0] != N or (8 * K8) % weight_scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} does not fit weight_packed {(N, K8)}")
    group_size = 8 * K8 // weight_scale.shape[1]
    return weight_packed.contiguous(), weight_scale.contiguous(), group_size


def unpack_int4_ref(weight_packed: torch.Tensor) -> torch.Tensor:
    """[N, K/8] int32 checkpoint words -> [N, K] int8 signed values q in [-8, 7]."""
    shifts = torch.arange(0, 32, 4, device=weight_packed.device, dtype=torch.int32)  # [8]
    nib = (weight_packed[..., None] >> shifts) & 0xF  # [N, K/8, 8]
    return (nib - 8).to(torch.int8).reshape(weight_packed.shape[0], -1)

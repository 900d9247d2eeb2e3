"""W4A16 GEMM/GEMV: `out[M, N] = x[M, K] @ dequant(w)[K, N]` with INT4 weights and group scales.

Checkpoint layout (compressed-tensors pack-quantized, symmetric): `weight_packed` int32 `[N, K/8]`,
nibble j of word i (little-endian) holds `q + 8` of element `k = 8i + j`; `weight_scale` `[N, K/G]`.
The kernels read that layout as it is (see `repack_int4` for why): each thread loads 16 bytes of
consecutive words along K and unpacks them into eight consecutive k per word.

Kernels:
- `_w4a16_gemv_tma_kernel` (M of 1-2, decode, G >= 32; the default): no tensor cores,
  `kernels/triton_lib.py`'s dot products (one LOP3 and one FFMA per weight; the -8 zero point once
  per word, the group scale once per 32 k); the word tiles stream in by TMA through a ring of
  `tma_stages` shared-memory buffers, so each program keeps `tma_stages - 1` tiles (16 KB each at
  128x256) in flight without registers or per-thread addresses; about one wave of programs
  (`TMA_PROGRAMS_PER_SM`), each with several K tiles; `gemv_rows = 2` runs both rows of M = 2
  against one word stream. (The plain GEMV keeps one tile in flight per program between its dots
  and needs several waves of short programs to cover HBM's latency: 0.46 of copy at 8192².)
- `_w4a16_gemv_kernel`: the same dots on 16-byte register loads (weights TMA cannot take, `lift`,
  A/B runs); `loop_stages` > 1 pipelines its K loop through cp.async, `prefetch` loads the next
  K tile into registers before this one's dots (ptxas tends to sink those loads towards the end of
  the loop body).
- `_w4a16_kernel` (M 3-64): tiles dequantized to the activation dtype in registers, then `tl.dot`
  (`swap_xw`: the transposed product, the dequantized tile as wgmma's register operand).
- prefill (M > 64): `dequantize_int4` once, then cuBLAS (twice as fast as the fused tiles on H200).
The GEMV and the tiles split K across programs when there are too few output tiles to fill the GPU; partial sums go to
an fp32 workspace and the last program of each tile (an atomic counter that resets itself) adds them
in a fixed order, so results are deterministic.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.formats.int4 import check_int4_operands, dequantize_int4
from kernels.int4_dequant import int4_dequant_triton
from kernels.split_k_merge import num_sms, split_k_counters
from kernels.triton_lib import (
    LIFT_SCALE,
    MAGIC_2_23,
    grouped_tile,
    int4_chunk_dots,
    int4_tile_dot,
    lift_rows,
    split_k_finish,
    unpack_tile,
    x_planes,
)

__all__ = [
    "W4A16Config",
    "pick_config",
    "w4a16_gemm",
    "w4a16_gemm_ref",
]


@triton.jit
def _tile_upto(w_ptr, s_ptr, rows, rows_ok, t, k8_end, stride_wn, stride_wk, stride_sn, stride_sg,
               GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr):  # fmt: skip
    """K tile t of weight rows `rows` [BN]: words [BK8, BN] int32 and fp32 scales [C, BN], both zero
    at or past word `k8_end` (a multiple of 4) and for rows past N; streamed (evicted from L2 first)."""
    BK8: tl.constexpr = BLOCK_K // 8
    C: tl.constexpr = BLOCK_K // 32
    r = t * BK8 + tl.arange(0, BK8)
    c = t * C + tl.arange(0, C)
    w_ok = (r < k8_end)[:, None]
    s_ok = (c < k8_end // 4)[:, None]
    if not EVEN_N:
        w_ok = w_ok & rows_ok[None, :]
        s_ok = s_ok & rows_ok[None, :]
    wptrs = w_ptr + rows[None, :] * stride_wn + r[:, None] * stride_wk
    sptrs = s_ptr + rows[None, :] * stride_sn + (c * 32 // GROUP_SIZE)[:, None] * stride_sg
    wp = tl.load(wptrs, mask=w_ok, other=0, eviction_policy="evict_first")
    return wp, tl.load(sptrs, mask=s_ok, other=0.0).to(tl.float32)


@triton.jit
def _gemv_slice(N, K8, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """A GEMV program's part, grid (N/BN, M, splits of K): its rows offs_n [BN] (n_ok: < N) and its
    K tiles [t0, t1) (none for a split past the last tile)."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_tiles = tl.cdiv(K8, BLOCK_K // 8)
    per_split = tl.cdiv(k_tiles, tl.num_programs(2))
    t0 = tl.program_id(2) * per_split
    return offs_n, offs_n < N, t0, tl.minimum(t0 + per_split, k_tiles)


@triton.jit
def _gemv_finish(acc, row, out_ptr, ws_ptr, cnt_ptr, offs_n, M, N, stride_om, stride_on):
    """A GEMV program's end, grid (N/BN, row groups, splits of K): its [C, BN] chunk sums (units of
    2^-72) of output row `row` to out, through the split-K workspace when K is split."""
    acc_n = tl.sum(acc, axis=0) * LIFT_SCALE  # [BN]
    split_k_finish(
        acc_n[None, :], out_ptr, ws_ptr, cnt_ptr, row + tl.arange(0, 1), offs_n, M, N, stride_om, stride_on,
        row * tl.num_programs(0) + tl.program_id(0), tl.program_id(2), tl.num_programs(2),
    )  # fmt: skip


@triton.jit
def _w4a16_gemv_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K8,  # K / 8 and K / G as arguments, not `K // 8` in the kernel: the launcher's divisibility-by-16
    KG,  # specialisation then lets the masked word loads be 16 bytes wide (8 with `K // 8`)
    stride_xm,
    stride_xk,
    stride_wk,
    stride_wn,
    stride_sg,
    stride_sn,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LIFTED: tl.constexpr,  # x is `lift_rows(x)` (fp32 [M, lifted width]), else the raw rows
    EVEN_K: tl.constexpr,  # K a multiple of BLOCK_K: no masks along K
    EVEN_N: tl.constexpr,  # N a multiple of BLOCK_N
    LOOP_STAGES: tl.constexpr,  # >1: the K loop pipelined (cp.async word tiles in flight), 1: plain
    PREFETCH: tl.constexpr,  # the next K tile's words and scales loaded into registers before this one's dots
):
    """x [M, K] (one row per program), w [N, K/8] int32, s [N, K/G] (G >= 32), out [M, N];
    grid (N/BN, M, splits of K). The dot products are `kernels/triton_lib.py`'s."""
    BK8: tl.constexpr = BLOCK_K // 8
    offs_n, n_ok, t0, t1 = _gemv_slice(N, K8, BLOCK_N, BLOCK_K)
    x_row = x_ptr + tl.program_id(1) * stride_xm
    acc = tl.zeros((BLOCK_K // 32, BLOCK_N), dtype=tl.float32)  # [C, BN], reduced over C at the end
    if PREFETCH:
        k8_end = tl.minimum(t1 * BK8, K8)  # this split's words end here: the prefetch past it loads nothing
        wp, sc = _tile_upto(w_ptr, s_ptr, offs_n, n_ok, t0, k8_end, stride_wn, stride_wk, stride_sn,
                            stride_sg, GROUP_SIZE, BLOCK_K, EVEN_N)  # fmt: skip
        for t in tl.range(t0, t1, num_stages=1):  # no cp.async pipeline: the tile in flight is in registers
            wn, sn = _tile_upto(w_ptr, s_ptr, offs_n, n_ok, t + 1, k8_end, stride_wn, stride_wk, stride_sn,
                                stride_sg, GROUP_SIZE, BLOCK_K, EVEN_N)  # fmt: skip
            r = t * BK8 + tl.arange(0, BK8)
            ys, xs = x_planes(x_row, r, r < K8, stride_xk, LIFTED, EVEN_K)
            acc += int4_chunk_dots(wp, sc, ys, xs, LIFTED)
            wp, sc = wn, sn
    else:
        for t in tl.range(t0, t1, num_stages=LOOP_STAGES):
            r = t * BK8 + tl.arange(0, BK8)
            ys, xs = x_planes(x_row, r, r < K8, stride_xk, LIFTED, EVEN_K)
            acc += int4_tile_dot(
                w_ptr, s_ptr, offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg, ys, xs,
                GROUP_SIZE, BLOCK_K, LIFTED, EVEN_K, EVEN_N,
            )  # fmt: skip
    _gemv_finish(acc, tl.program_id(1), out_ptr, ws_ptr, cnt_ptr, offs_n, M, N, stride_om, stride_on)


@triton.jit
def _scales(s_ptr, rows, rows_ok, t, c_end, stride_sn, stride_sg, GROUP_SIZE: tl.constexpr, C: tl.constexpr,
            EVEN_N: tl.constexpr):  # fmt: skip
    """fp32 scales [C, BN] of K tile t's chunks (C of 32 k) for `rows`; zero from chunk `c_end`."""
    c = t * C + tl.arange(0, C)
    ok = (c < c_end)[:, None]
    if not EVEN_N:
        ok = ok & rows_ok[None, :]
    sptrs = s_ptr + rows[None, :] * stride_sn + (c * 32 // GROUP_SIZE)[:, None] * stride_sg
    return tl.load(sptrs, mask=ok, other=0.0).to(tl.float32)


@triton.jit
def _w4a16_gemv_tma_kernel(
    x_ptr,
    w_desc,  # TMA descriptor of w [N, K/8] int32, blocks [BLOCK_N, BLOCK_K/8] (zero past the edges)
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    M,
    N,
    K8,  # K / 8: see _w4a16_gemv_kernel
    stride_xm,
    stride_xk,
    stride_sg,
    stride_sn,
    stride_om,
    stride_on,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    STAGES: tl.constexpr,  # word tiles the TMA engine keeps in flight per program (shared memory)
    ROWS: tl.constexpr,  # 1 or 2 activation rows against one word stream (their LOP3s shared)
):
    """`_w4a16_gemv_kernel` with the word tiles streamed by TMA into a `STAGES`-deep shared-memory
    ring (no registers and no per-thread addresses for the bytes in flight; the dots read the
    tiles back K-major). Scales and activations are plain loads (L1/L2 hits: a scale line serves
    several tiles; the next tile's scales load before this one's dots). grid (N/BN, M/ROWS, K splits)."""
    BK8: tl.constexpr = BLOCK_K // 8
    C: tl.constexpr = BLOCK_K // 32
    offs_n, n_ok, t0, t1 = _gemv_slice(N, K8, BLOCK_N, BLOCK_K)
    row = tl.program_id(1) * ROWS
    x_row = x_ptr + row * stride_xm
    x_row1 = x_ptr + tl.minimum(row + 1, M - 1) * stride_xm  # ROWS = 2 (past M: a real row, not stored)
    acc = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    acc1 = tl.zeros((C, BLOCK_N), dtype=tl.float32)
    c_end = tl.minimum(t1 * C, K8 // 4)  # the split's chunks end here: the scale prefetch past it loads none
    sc = _scales(s_ptr, offs_n, n_ok, t0, c_end, stride_sn, stride_sg, GROUP_SIZE, C, EVEN_N)
    for t in tl.range(t0, t1, num_stages=STAGES):
        wp = tl.trans(w_desc.load([tl.program_id(0) * BLOCK_N, t * BK8]))  # [BK8, BN] int32
        sc_next = _scales(s_ptr, offs_n, n_ok, t + 1, c_end, stride_sn, stride_sg, GROUP_SIZE, C, EVEN_N)
        r = t * BK8 + tl.arange(0, BK8)
        ys, xs = x_planes(x_row, r, r < K8, stride_xk, False, EVEN_K)
        acc += int4_chunk_dots(wp, sc, ys, xs, False)
        if ROWS == 2:
            ys, xs = x_planes(x_row1, r, r < K8, stride_xk, False, EVEN_K)
            acc1 += int4_chunk_dots(wp, sc, ys, xs, False)
        sc = sc_next
    _gemv_finish(acc, row, out_ptr, ws_ptr, cnt_ptr, offs_n, M, N, stride_om, stride_on)
    if ROWS == 2 and row + 1 < M:
        _gemv_finish(acc1, row + 1, out_ptr, ws_ptr, cnt_ptr, offs_n, M, N, stride_om, stride_on)


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
    K8,  # K / 8 and K / G: see _w4a16_gemv_kernel
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
):
    """x [M, K], w [N, K/8] int32, s [N, K/G], out [M, N]; grid (tiles of M×N, SPLIT_K)."""
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


@dataclass(frozen=True, slots=True)
class W4A16Config:
    """Tile shape and launch parameters; `block_m == 0` selects the GEMV kernel; `dense` dequantizes
    the weight to the activation dtype (tiles of block_n × block_k) and hands the product to cuBLAS."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    group_m: int = 8
    dense: bool = False
    lift: bool = False  # GEMV: activations lifted by a separate launch (`lift_rows`), not in the kernel
    # GEMV: >1 pipelines its K loop (`tl.range` stages: word tiles in flight through cp.async)
    loop_stages: int = 1
    # GEMV: the next K tile's words held in registers while this one's dots run (ptxas may sink the
    # loads towards the loop's end: see `bench_w4a16`'s sweep before making it a default)
    prefetch: bool = False
    # GEMV: > 1 streams the word tiles by TMA through a ring of that many stages (`_w4a16_gemv_tma_kernel`)
    tma_stages: int = 0
    gemv_rows: int = 1  # TMA GEMV: activation rows (1 or 2) a program runs against one word stream
    swap_xw: bool = False  # tiles: out^T = w x^T, the dequantized w straight from registers into wgmma


# Launcher defaults (from `bench_w4a16 --quick` on the H200; update them from its printed table): the
# GEMV's tiles, how many of its programs split K aims for per SM and the rows up to which it runs;
# the tensor-core tiles by the largest M they serve (split K at 4 programs per SM); the prefill path.
# The TMA GEMV (`tma_stages` > 1) lost to the plain one on every decode shape of the H200 sweep
# (`lab.diagnostics.w4a16_decode_sweep`, 2026-12-04, lab/results/2026-12-04-r6/w4a16_decode.log: one
# GLM 5.2 layer's matrices 74.2 vs 68.3 us), so the default stays the plain GEMV; the TMA ring is a
# sweep candidate (GEMV_TMA)
GEMV_DEFAULT = W4A16Config(block_m=0, block_n=128, block_k=256, num_warps=4)
GEMV_TMA = replace(GEMV_DEFAULT, tma_stages=4)
GEMV_PROGRAMS_PER_SM = 12  # the plain GEMV: several waves (a last wave of a few runs latency-bound)
# the TMA GEMV's programs hold their bytes in flight in shared memory (48 KB at 128x256, 4 stages:
# 4 fit an SM): about one wave of them, each with several K tiles to stream
TMA_PROGRAMS_PER_SM = 4
# a weight too narrow for GEMV_DEFAULT's tiles to fill half that wave (at most 16 splits of 2+ K
# tiles): rows in half the tiles (24 KB of ring, 8 programs an SM), twice the programs streaming
GEMV_NARROW = (W4A16Config(block_m=0, block_n=64, block_k=256, num_warps=4, tma_stages=4), 8)
GEMV_MAX_M = 2  # the GEMV reads the weights once per row: past a few rows the tiles win
TILE_DEFAULTS = (
    (16, W4A16Config(block_m=16, block_n=64, block_k=128, num_stages=4)),
    (32, W4A16Config(block_m=32, block_n=64, block_k=128, num_stages=4)),
    (64, W4A16Config(block_m=64, block_n=64, block_k=128, num_stages=4)),
)
# prefill: one dequantizing pass (~N·K·2.5 bytes) then cuBLAS beat the fused tiles 2× on H200
PREFILL_DEFAULT = W4A16Config(block_m=0, block_n=32, block_k=256, num_warps=4, dense=True)


def pick_config(M: int, N: int, K: int, num_sms: int, group_size: int = 32) -> W4A16Config:
    """By M from the tables above: the GEMV (by N, narrow or not), the first tiles whose bound holds,
    else prefill."""
    if M <= GEMV_MAX_M and group_size >= 32:  # decode: both rows of M = 2 against one word stream
        rows = min(M, 2)
        cfg = with_split_k(replace(GEMV_DEFAULT, gemv_rows=rows), M, N, K, num_sms)
        wave = TMA_PROGRAMS_PER_SM * num_sms * 4 // cfg.num_warps
        if cfg.tma_stages > 1 and 2 * triton.cdiv(N, cfg.block_n) * cfg.split_k < wave:
            return with_split_k(replace(GEMV_NARROW[0], gemv_rows=rows), M, N, K, num_sms, GEMV_NARROW[1])
        return cfg
    cfg = next((cfg for bound, cfg in TILE_DEFAULTS if bound >= M), None)
    return PREFILL_DEFAULT if cfg is None else with_split_k(cfg, M, N, K, num_sms)


def with_split_k(
    cfg: W4A16Config, M: int, N: int, K: int, num_sms: int, per_sm: int | None = None
) -> W4A16Config:
    """Split K until there are about `per_sm` programs per SM (default: 4, the GEMV
    `GEMV_PROGRAMS_PER_SM` of 4 warps, the TMA GEMV `TMA_PROGRAMS_PER_SM`), to the nearest split (at
    most 16, of 4+ K tiles each; GEMV 2+; every split with work)."""
    rows = (
        triton.cdiv(M, cfg.gemv_rows if cfg.tma_stages > 1 else 1)
        if cfg.block_m == 0
        else triton.cdiv(M, cfg.block_m)
    )
    tiles = triton.cdiv(N, cfg.block_n) * rows
    k_tiles = triton.cdiv(K, cfg.block_k)
    if cfg.block_m == 0:
        default = TMA_PROGRAMS_PER_SM if cfg.tma_stages > 1 else GEMV_PROGRAMS_PER_SM
        target, min_tiles = (per_sm or default) * num_sms * 4 // cfg.num_warps, 2
    else:
        target, min_tiles = (per_sm or 4) * num_sms, 4
    split = max(1, min(k_tiles // min_tiles, round(target / tiles), 16))
    return replace(cfg, split_k=triton.cdiv(k_tiles, triton.cdiv(k_tiles, split)))  # every split with work


def w4a16_gemm(
    x: torch.Tensor,  # [..., K] fp16 / bf16 / fp32
    w_repacked: torch.Tensor,  # [N, K/8] int32 from repack_int4
    scales: torch.Tensor,  # [N, K/G] float
    group_size: int,
    config: W4A16Config | None = None,
    out: torch.Tensor | None = None,  # [M, N] contiguous, x's dtype: for preallocated (graph) buffers
) -> torch.Tensor:
    """`x @ dequant(w)` in x's dtype; [..., N]."""
    if group_size % 8 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two and a multiple of 8, got {group_size}")
    check_int4_operands(x, w_repacked, scales, group_size)
    K, N = x.shape[-1], w_repacked.shape[0]
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if out is None:
        out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    elif out.shape != (M, N) or out.dtype != x.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {x.dtype} [{M}, {N}]")
    if M == 0:
        return out.reshape(*lead, N)
    cfg = config or pick_config(M, N, K, num_sms(x.device), group_size)
    ws = torch.empty((cfg.split_k, M, N) if cfg.split_k > 1 else (1,), dtype=torch.float32, device=x.device)
    strides = (
        *x2.stride(),
        w_repacked.stride(1),
        w_repacked.stride(0),
        scales.stride(1),
        scales.stride(0),
        *out.stride(),
    )
    scale_rows = max(cfg.block_k // group_size, 1)
    if cfg.dense:
        _dense_product(x2, w_repacked, scales, group_size, cfg, out)
    elif cfg.block_m == 0:
        if group_size < 32 or cfg.block_k % 32:
            raise ValueError(
                f"the GEMV needs group_size >= 32 and block_k % 32 == 0, got {group_size}, {cfg}"
            )
        grid = (triton.cdiv(N, cfg.block_n), M, cfg.split_k)
        cnt = split_k_counters(x.device, grid[0] * M)
        if cfg.gemv_rows not in (1, 2):
            raise ValueError(f"the GEMV runs 1 or 2 rows a program, got {cfg}")
        if cfg.tma_stages > 1 and not cfg.lift and tma_fits(w_repacked, cfg):
            _w4a16_gemv_tma_kernel[(grid[0], triton.cdiv(M, cfg.gemv_rows), cfg.split_k)](
                x2,
                TensorDescriptor.from_tensor(w_repacked, [cfg.block_n, cfg.block_k // 8]),
                scales,
                out,
                ws,
                cnt,
                M,
                N,
                K // 8,
                *x2.stride(),
                *strides[4:],
                GROUP_SIZE=group_size,
                BLOCK_N=cfg.block_n,
                BLOCK_K=cfg.block_k,
                EVEN_K=K % cfg.block_k == 0,
                EVEN_N=N % cfg.block_n == 0,
                STAGES=cfg.tma_stages,
                ROWS=cfg.gemv_rows,
                num_warps=cfg.num_warps,
                num_stages=1,
            )
            return out.reshape(*lead, N)
        xg = lift_rows(x2) if cfg.lift else x2  # [M, K] or [M, lifted_width(K)] fp32
        _w4a16_gemv_kernel[grid](
            xg,
            w_repacked,
            scales,
            out,
            ws,
            cnt,
            M,
            N,
            K // 8,
            K // group_size,
            *xg.stride(),
            *strides[2:],
            GROUP_SIZE=group_size,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            LIFTED=cfg.lift,
            EVEN_K=K % cfg.block_k == 0,
            EVEN_N=N % cfg.block_n == 0,
            LOOP_STAGES=cfg.loop_stages,
            PREFETCH=cfg.prefetch,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    else:
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
            SCALE_ROWS=scale_rows,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            SWAP_XW=cfg.swap_xw,
            num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return out.reshape(*lead, N)


def tma_fits(w: torch.Tensor, cfg: W4A16Config) -> bool:
    """Whether TMA can stream `w` [N, K/8] int32 in `cfg`'s word tiles: a contiguous weight on a
    16-byte boundary with 16-byte rows (K a multiple of 32), boxes of at most 256 by 256 words."""
    return (
        w.is_contiguous()
        and w.data_ptr() % 16 == 0
        and w.shape[1] % 4 == 0
        and cfg.block_n <= 256
        and 4 <= cfg.block_k // 8 <= 256
    )


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

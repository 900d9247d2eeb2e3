"""The W4A16 GEMV (decode, M of 1-2, G >= 32) of `kernels/w4a16_gemm.py`: `out[M, N] = x[M, K] @
dequant(w)[K, N]` on the CUDA cores, weights in the checkpoint layout (`weight_packed` int32 `[N, K/8]`,
`weight_scale` `[N, K/G]`; `kernels/w4a16_gemm.py` describes it).

- `_w4a16_gemv_tma_kernel`: no tensor cores, `kernels/triton_lib.py`'s dot products (one LOP3 and
  one FFMA per weight; the -8 zero point once per word, the group scale once per 32 k); the word
  tiles stream in by TMA through a ring of `tma_stages` shared-memory buffers, so each program keeps
  `tma_stages - 1` tiles (16 KB each at 128x256) in flight without registers or per-thread
  addresses; about one wave of programs (`TMA_PROGRAMS_PER_SM`), each with several K tiles;
  `gemv_rows = 2` runs both rows of M = 2 against one word stream. (The plain GEMV keeps one tile in
  flight per program between its dots and needs several waves of short programs to cover HBM's
  latency: 0.46 of copy at 8192².)
- `_w4a16_gemv_kernel` (the default, `kernels/w4a16_config.py`): the same dots on 16-byte register
  loads (weights TMA cannot take, `lift`, A/B runs); `loop_stages` > 1 pipelines its K loop through
  cp.async, `prefetch` loads the next K tile into registers before this one's dots (ptxas tends to
  sink those loads towards the end of the loop body).
Both split K across programs when there are too few output tiles to fill the GPU (`split_k_finish`).
Under PDL (`kernels/triton_lib.py`) a program's first weights are on their way before its wait, as
the kernel before finishes: the plain GEMV asks L2 for its first K tile (words and scales; loaded
into registers instead, held across the wait, its sm90 build went from 96 to 126 registers a thread,
5 to 4 programs an SM, 2026-12-05), the `prefetch` variant and the TMA GEMV load their first words or
scales into registers, as they already did before the loop.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from kernels.split_k_merge import split_k_counters
from kernels.triton_lib import (
    LIFT_SCALE,
    int4_chunk_dots,
    int4_tile_dot,
    lift_rows,
    pdl_args,
    pdl_launch_dependents,
    pdl_wait,
    prefetch_l2,
    split_k_finish,
    x_planes,
)
from kernels.w4a16_config import W4A16Config

__all__ = ["tma_fits", "w4a16_gemv"]


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
def _prefetch_tile(w_ptr, s_ptr, rows, rows_ok, t, k8_end, stride_wn, stride_wk, stride_sn, stride_sg,
                   GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """K tile t of weight rows `rows` [BN] on its way to L2 (`prefetch_l2`), words and scales: a
    row's words are BK/2 bytes, one prefetch per 128 (32 words); its scales one (BK/G of them)."""
    LINES: tl.constexpr = (BLOCK_K // 2 + 127) // 128
    r = t * (BLOCK_K // 8) + tl.arange(0, LINES) * 32  # [LINES] first word of each line
    prefetch_l2(
        w_ptr + rows[None, :] * stride_wn + r[:, None] * stride_wk, rows_ok[None, :] & (r < k8_end)[:, None]
    )
    g = t * BLOCK_K // GROUP_SIZE
    prefetch_l2(s_ptr + rows * stride_sn + g * stride_sg, rows_ok & (t * (BLOCK_K // 8) < k8_end))


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
    PDL: tl.constexpr,  # launched with PDL: the first K tile goes to L2 (PREFETCH: registers) before the wait
):
    """x [M, K] (one row per program), w [N, K/8] int32, s [N, K/G] (G >= 32), out [M, N];
    grid (N/BN, M, splits of K). The dot products are `kernels/triton_lib.py`'s."""
    pdl_launch_dependents(PDL)
    BK8: tl.constexpr = BLOCK_K // 8
    offs_n, n_ok, t0, t1 = _gemv_slice(N, K8, BLOCK_N, BLOCK_K)
    x_row = x_ptr + tl.program_id(1) * stride_xm
    acc = tl.zeros((BLOCK_K // 32, BLOCK_N), dtype=tl.float32)  # [C, BN], reduced over C at the end
    k8_end = tl.minimum(t1 * BK8, K8)  # this split's words end here: a tile past it loads nothing
    if PREFETCH:
        wp, sc = _tile_upto(w_ptr, s_ptr, offs_n, n_ok, t0, k8_end, stride_wn, stride_wk, stride_sn,
                            stride_sg, GROUP_SIZE, BLOCK_K, EVEN_N)  # fmt: skip
        pdl_wait(PDL)  # the weights are constant (rule 2): the first tile is in flight across the wait
        for t in tl.range(t0, t1, num_stages=1):  # no cp.async pipeline: the tile in flight is in registers
            wn, sn = _tile_upto(w_ptr, s_ptr, offs_n, n_ok, t + 1, k8_end, stride_wn, stride_wk, stride_sn,
                                stride_sg, GROUP_SIZE, BLOCK_K, EVEN_N)  # fmt: skip
            r = t * BK8 + tl.arange(0, BK8)
            ys, xs = x_planes(x_row, r, r < K8, stride_xk, LIFTED, EVEN_K)
            acc += int4_chunk_dots(wp, sc, ys, xs, LIFTED)
            wp, sc = wn, sn
    else:
        if PDL:  # constant (rule 2), and in L2 by the time the loop asks
            _prefetch_tile(w_ptr, s_ptr, offs_n, n_ok, t0, k8_end, stride_wn, stride_wk, stride_sn, stride_sg,
                           GROUP_SIZE, BLOCK_K)  # fmt: skip
        pdl_wait(PDL)
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
    PDL: tl.constexpr,  # launched with PDL: the first scales load before the wait
):
    """`_w4a16_gemv_kernel` with the word tiles streamed by TMA into a `STAGES`-deep shared-memory
    ring (no registers and no per-thread addresses for the bytes in flight; the dots read the
    tiles back K-major). Scales and activations are plain loads (L1/L2 hits: a scale line serves
    several tiles; the next tile's scales load before this one's dots). grid (N/BN, M/ROWS, K splits)."""
    pdl_launch_dependents(PDL)
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
    pdl_wait(PDL)  # the scales are constant (rule 2); the word tiles stream in after it
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


def w4a16_gemv(
    x: torch.Tensor,  # [M, K]
    w: torch.Tensor,  # [N, K/8] int32
    scales: torch.Tensor,  # [N, K/G]
    group_size: int,
    cfg: W4A16Config,  # block_m == 0
    out: torch.Tensor,  # [M, N]
    ws: torch.Tensor,  # [split_k, M, N] fp32 when K is split
) -> None:
    """Decode: `out = x @ dequant(w)` by the TMA GEMV where `cfg` asks for it and TMA can take `w`,
    else by the plain one."""
    if group_size < 32 or cfg.block_k % 32:
        raise ValueError(f"the GEMV needs group_size >= 32 and block_k % 32 == 0, got {group_size}, {cfg}")
    if cfg.gemv_rows not in (1, 2):
        raise ValueError(f"the GEMV runs 1 or 2 rows a program, got {cfg}")
    (M, K), N = x.shape, w.shape[0]
    grid = (triton.cdiv(N, cfg.block_n), M, cfg.split_k)
    cnt = split_k_counters(x.device, grid[0] * M)
    if cfg.tma_stages > 1 and not cfg.lift and tma_fits(w, cfg):
        _w4a16_gemv_tma_kernel[(grid[0], triton.cdiv(M, cfg.gemv_rows), cfg.split_k)](
            x,
            TensorDescriptor.from_tensor(w, [cfg.block_n, cfg.block_k // 8]),
            scales,
            out,
            ws,
            cnt,
            M,
            N,
            K // 8,
            *x.stride(),
            scales.stride(1),
            scales.stride(0),
            *out.stride(),
            GROUP_SIZE=group_size,
            BLOCK_N=cfg.block_n,
            BLOCK_K=cfg.block_k,
            EVEN_K=K % cfg.block_k == 0,
            EVEN_N=N % cfg.block_n == 0,
            STAGES=cfg.tma_stages,
            ROWS=cfg.gemv_rows,
            **pdl_args(x.device),
            num_warps=cfg.num_warps,
            num_stages=1,
        )
        return
    xg = lift_rows(x) if cfg.lift else x  # [M, K] or [M, lifted_width(K)] fp32
    _w4a16_gemv_kernel[grid](
        xg,
        w,
        scales,
        out,
        ws,
        cnt,
        M,
        N,
        K // 8,
        K // group_size,
        *xg.stride(),
        w.stride(1),
        w.stride(0),
        scales.stride(1),
        scales.stride(0),
        *out.stride(),
        GROUP_SIZE=group_size,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        LIFTED=cfg.lift,
        EVEN_K=K % cfg.block_k == 0,
        EVEN_N=N % cfg.block_n == 0,
        LOOP_STAGES=cfg.loop_stages,
        PREFETCH=cfg.prefetch,
        **pdl_args(x.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )


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

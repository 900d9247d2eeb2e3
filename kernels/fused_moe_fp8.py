"""Fused MoE with FP8 e4m3 routed experts (W8A16): `out[t] = sum_j w[t, j] · down_e(silu(gate_e(x_t)) * up_e(x_t))`
with `e = ids[t, j]`, read in place from the experts' FP8 bytes (no bf16 copy of any expert).

The FP8 peer of `kernels/fused_moe.py`: the same alignment, grids, GEMV/tile switch, split-K and k-sum
(`kernels/moe_routing.py`), only the weight loads differ. Shape letters as there (M tokens, k slots,
P = M·k pairs, E experts, H hidden, I intermediate, BM/BN/BK tiles). Weights as
`backend.quant.experts.QuantExperts` holds them: `w13 [E, 2I, H]` e4m3 (gate rows 0..I-1, up rows
I..2I-1), `w2 [E, H, I]` e4m3, and one of two scale formats (dequantized = weight · scale):
- per output channel (`block=None`): gate_scale, up_scale `[E, I, 1]` (the halves of `[E, 2I, 1]`),
  down_scale `[E, H, 1]`; applied once to the fp32 accumulator after the K loop;
- 128×128 blocks (`block=(bn, bk)`): gate_scale, up_scale `[E, ⌈I/bn⌉, ⌈H/bk⌉]`, down_scale
  `[E, ⌈H/bn⌉, ⌈I/bk⌉]`; BLOCK_K divides bk, so each K tile lies in one scale block and its partial
  product is scaled as it is added (the DeepSeek-V3 / vLLM `w8a8_block` scheme).

Weights are upcast to the activation dtype in registers (e4m3 ⊂ bf16 and fp16: exact) and multiplied
by bf16 tensor cores (`tl.dot`) or, in the GEMV, fp32 FMAs; activations stay bf16. Why not FP8
`tl.dot` with FP8-quantized activations: decode is memory-bound (at one token per expert the tensor
cores idle either way, and the time is the weight bytes, the same for both), and the FP8 product
would add the activations' e4m3 rounding (~2^-4 relative, test_w4a8_gemm.py derives it) and a
quantize step per GEMM; FP8 tensor cores pay only in compute-bound prefill (many tokens per expert),
left for when a prefill benchmark says so. Scales are applied in fp32, so the only roundings are
act and y to the activation dtype, as in the INT4 kernel.

No device time yet: tiles are the INT4 kernel's (`pick_moe_config`), checked only by an offline sm_90a
compile (`tests/kernels/sm90_compile_fused_moe.py`); `benchmarks/kernels/bench_fused_moe.py` times
it as the `fp8` peer of the INT4 rows.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from kernels.formats.fp8 import FP8, dequantize_fp8
from kernels.moe_routing import (
    Blocks,
    MoEConfig,
    MoEGemm,
    check_routing,
    pick_moe_config,
    run_moe,
)
from kernels.triton_lib import (
    moe_block_rows,
    moe_gemv_finish,
    moe_pair_expert,
    moe_tile_epilogue,
    pdl_args,
    pdl_enter,
)

__all__ = ["fused_moe_fp8", "fused_moe_fp8_ref", "pick_fp8_moe_config"]


@triton.jit
def _tile_dot(acc, a, w_e, s_e, rows, rows_ok, s_rows, kk, k_ok, t, stride_wn, stride_wk, stride_sk,
              SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr, DOT_PRECISION: tl.constexpr):  # fmt: skip
    """`acc + a · w[rows, kk]ᵀ` for a [BM, BK]; block scales (SCALE_BK > 0) applied to this K tile's product."""
    w = tl.load(
        w_e + rows[:, None] * stride_wn + kk[None, :] * stride_wk,
        mask=rows_ok[:, None] & k_ok[None, :],
        other=0.0,
    ).to(a.dtype)  # [BN, BK]: e4m3 -> bf16/fp16/fp32 is exact
    if SCALE_BK == 0:
        return tl.dot(a, tl.trans(w), acc, input_precision=DOT_PRECISION)
    sc = tl.load(s_e + s_rows + (t * BLOCK_K // SCALE_BK) * stride_sk, mask=rows_ok, other=0.0).to(tl.float32)
    return acc + tl.dot(a, tl.trans(w), input_precision=DOT_PRECISION) * sc[None, :]


@triton.jit
def _fused_moe_fp8_kernel(
    a_ptr,
    w_ptr,
    s_ptr,  # gate (or down) scales
    s_up_ptr,  # up scales (GATE_UP), same strides as s_ptr
    out_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    num_pairs,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_om,
    stride_on,
    A_ROW_DIV: tl.constexpr,  # a row = pair // A_ROW_DIV: k for x (gate/up), 1 for act (down)
    GATE_UP: tl.constexpr,  # weight rows n and N + n, silu(gate) * up in the epilogue
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    SCALE_BN: tl.constexpr,  # weight rows per scale row: 1 per channel, bn for blocks
    SCALE_BK: tl.constexpr,  # 0 per channel, else bk (a multiple of BLOCK_K)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): the blocks are read after the wait
):
    """a [M or P, K], w [E, N or 2N, K] e4m3, s / s_up [E, N or ⌈N/bn⌉, 1 or ⌈K/bk⌉] fp32, out [P, N],
    topk_w [P], sorted_ids / block_expert_ids / num_padded from `moe_align`; grid (num_blocks · cdiv(N, BN),)."""
    pdl_enter(PDL)
    expert, pair, m_ok, offs_n, n_ok, out_ptrs, out_mask = moe_block_rows(
        tl.program_id(0), N, num_pairs, sorted_ids_ptr, block_expert_ids_ptr, num_padded_ptr, out_ptr,
        stride_om, stride_on, GATE_UP, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if expert < 0:
        return
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    su_e = s_up_ptr + expert.to(tl.int64) * stride_se
    s_rows = (offs_n // SCALE_BN) * stride_sn  # [BN]
    a_rows = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tl.cdiv(K, BLOCK_K)):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < K
        a = tl.load(a_rows[:, None] + kk[None, :] * stride_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        acc = _tile_dot(
            acc, a, w_e, s_e, offs_n, n_ok, s_rows, kk, k_ok, t, stride_wn, stride_wk, stride_sk,
            SCALE_BK, BLOCK_K, DOT_PRECISION,
        )  # fmt: skip
        if GATE_UP:
            acc_up = _tile_dot(
                acc_up, a, w_e, su_e, N + offs_n, n_ok, s_rows, kk, k_ok, t, stride_wn, stride_wk, stride_sk,
                SCALE_BK, BLOCK_K, DOT_PRECISION,
            )  # fmt: skip
    if SCALE_BK == 0:  # per channel: once, after the K loop
        acc = acc * tl.load(s_e + s_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATE_UP:
            acc_up = acc_up * tl.load(su_e + s_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    moe_tile_epilogue(acc, acc_up, topk_w_ptr, pair, m_ok, out_ptrs, out_mask, GATE_UP, MUL_WEIGHT)


@triton.jit
def _gemv_tile(acc2, x, w_e, s_e, rows, rows_ok, s_rows, kk, k_ok, t, stride_wn, stride_wk, stride_sk,
               SCALE_BK: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """`acc2 + w[rows, kk] * x[kk]` elementwise [BN, BK] fp32 (reduced over K once, by the caller)."""
    w = tl.load(
        w_e + rows[:, None] * stride_wn + kk[None, :] * stride_wk,
        mask=rows_ok[:, None] & k_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if SCALE_BK == 0:
        return acc2 + w * x[None, :]
    sc = tl.load(s_e + s_rows + (t * BLOCK_K // SCALE_BK) * stride_sk, mask=rows_ok, other=0.0).to(tl.float32)
    return acc2 + w * x[None, :] * sc[:, None]


@triton.jit
def _fused_moe_fp8_gemv_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    s_up_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    topk_w_ptr,
    add_ptr,  # ADD: [M, N] added to down's rows (out's strides), else a placeholder
    topk_ids_ptr,
    num_experts,
    N,
    K,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sk,
    stride_om,
    A_ROW_DIV: tl.constexpr,
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    SCALE_BN: tl.constexpr,
    SCALE_BK: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    ADD: tl.constexpr,  # down: add's rows added to the finished sums (`moe_gemv_finish`)
    PDL: tl.constexpr,  # launched with PDL: nothing before the wait (the experts are the router's output)
):
    """Sparse decode: a, w, s, s_up as `_fused_moe_fp8_kernel`, topk_w [P], topk_ids [P] (outside [0, E):
    not on this rank); grid (P, cdiv(N, BN), splits of K). out: GATE_UP: act [P, N]; else [M, N], the
    k-sum done (`moe_gemv_finish`, with the fp32 workspace ws and the counters cnt)."""
    pdl_enter(PDL)
    pair = tl.program_id(0)
    expert, is_local = moe_pair_expert(pair, num_experts, topk_ids_ptr)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    su_e = s_up_ptr + expert * stride_se
    s_rows = (offs_n // SCALE_BN) * stride_sn
    x_row = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    offs_k = tl.arange(0, BLOCK_K)
    acc2 = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc2_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    per_split = tl.cdiv(k_tiles, tl.num_programs(2))
    t0 = tl.program_id(2) * per_split
    t1 = tl.where(is_local, tl.minimum(t0 + per_split, k_tiles), t0)  # another rank's pair: no K loop
    for t in range(t0, t1):
        kk = t * BLOCK_K + offs_k
        k_ok = kk < K
        x = tl.load(x_row + kk * stride_ak, mask=k_ok, other=0.0).to(tl.float32)  # [BK]
        acc2 = _gemv_tile(
            acc2, x, w_e, s_e, offs_n, n_ok, s_rows, kk, k_ok, t, stride_wn, stride_wk, stride_sk,
            SCALE_BK, BLOCK_K,
        )  # fmt: skip
        if GATE_UP:
            acc2_up = _gemv_tile(
                acc2_up, x, w_e, su_e, N + offs_n, n_ok, s_rows, kk, k_ok, t, stride_wn, stride_wk, stride_sk,
                SCALE_BK, BLOCK_K,
            )  # fmt: skip
    acc = tl.sum(acc2, axis=1)  # [BN]
    acc_up = tl.sum(acc2_up, axis=1)
    if SCALE_BK == 0:  # another rank's pair loads nothing
        acc = acc * tl.load(s_e + s_rows, mask=n_ok & is_local, other=0.0).to(tl.float32)
        if GATE_UP:
            acc_up = acc_up * tl.load(su_e + s_rows, mask=n_ok & is_local, other=0.0).to(tl.float32)
    moe_gemv_finish(
        acc, acc_up, pair, is_local, offs_n, n_ok, N, out_ptr, stride_om, ws_ptr, cnt_ptr, topk_w_ptr, add_ptr,
        topk_ids_ptr, num_experts, GATE_UP, False, TOP_K, ADD,
    )  # fmt: skip


# The GEMV's tiles ([BN, BK] fp32 products per program: 2.7-2.8 TB/s on Kimi's experts, H200) and
# the pairs per expert up to which it runs (measured at one; the INT4 GEMV's switch is higher)
FP8_GEMV_CONFIG = MoEConfig(block_m=0, block_n=32, block_k=128)
FP8_GEMV_MAX_PAIRS_PER_EXPERT = 1.0


def pick_fp8_moe_config(num_pairs: int, num_experts: int, block: tuple[int, int] | None) -> MoEConfig:
    """The INT4 kernel's switch and tensor-core tiles (`pick_moe_config`) with `FP8_GEMV_CONFIG`, and
    8 warps for block scales at BM 64: the two accumulators and the two K-tile products need 255
    registers at 4 warps (a spill), 102 at 8 (`tests/kernels/sm90_compile_fused_moe.py`)."""
    cfg = pick_moe_config(num_pairs, num_experts, FP8_GEMV_CONFIG, (), FP8_GEMV_MAX_PAIRS_PER_EXPERT)
    if block is not None and cfg.block_m >= 64:
        return dataclasses.replace(cfg, num_warps=8)
    return cfg


def _scale_shape(E: int, N: int, K: int, block: tuple[int, int] | None) -> tuple[int, int, int]:
    return (E, N, 1) if block is None else (E, triton.cdiv(N, block[0]), triton.cdiv(K, block[1]))


def _check(
    w: torch.Tensor, shape: tuple[int, int, int], scales: dict[str, torch.Tensor], s_shape: tuple, name: str
) -> None:
    if w.dtype != FP8 or tuple(w.shape) != shape or w.stride(-1) != 1:
        raise ValueError(
            f"{name} must be {FP8} {list(shape)} contiguous along K, got {w.dtype} {tuple(w.shape)}"
        )
    for s_name, s in scales.items():
        if not s.is_floating_point() or tuple(s.shape) != s_shape:
            raise ValueError(f"{s_name} must be float {list(s_shape)}, got {s.dtype} {tuple(s.shape)}")


def fused_moe_fp8(
    x: torch.Tensor,  # [M, H] fp16 / bf16 / fp32
    topk_ids: torch.Tensor,  # [M, k] int, local expert ids (outside [0, E): another rank's, skipped)
    topk_weights: torch.Tensor,  # [M, k] float (routed scaling already folded in, as Router returns)
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w2: torch.Tensor,  # [E, H, I] e4m3
    gate_scale: torch.Tensor,  # [E, I, 1] per channel, or [E, ⌈I/bn⌉, ⌈H/bk⌉] blocks
    up_scale: torch.Tensor,  # as gate_scale, same strides
    down_scale: torch.Tensor,  # [E, H, 1] or [E, ⌈H/bn⌉, ⌈I/bk⌉]
    block: tuple[int, int] | None = None,  # None: per-channel scales; (bn, bk): block scales
    config: MoEConfig | None = None,
    add: torch.Tensor | None = None,  # [M, H] x's dtype, contiguous: added to the sum (the shared experts)
    local_share: float = 1.0,  # expert parallel: E local / E in all (`run_moe` sizes the GEMV's splits)
) -> torch.Tensor:
    """`sum_j w[:, j] · down(silu(gate(x)) * up(x))` over each token's experts (`+ add`, the sum rounded
    to x's dtype first, as torch adds two tensors); [M, H] in x's dtype."""
    check_routing(x, topk_ids, topk_weights, w13, w2, gate_scale, up_scale, down_scale)
    if block is not None and (block[1] < 16 or block[1] & (block[1] - 1)):
        raise ValueError(f"block scales need a power-of-two K block >= 16, got {block}")
    M, H = x.shape
    E, I = w13.shape[0], w13.shape[1] // 2
    _check(
        w13,
        (E, 2 * I, H),
        {"gate_scale": gate_scale, "up_scale": up_scale},
        _scale_shape(E, I, H, block),
        "w13",
    )
    _check(w2, (E, H, I), {"down_scale": down_scale}, _scale_shape(E, H, I, block), "w2")
    if gate_scale.stride() != up_scale.stride():
        raise ValueError(
            f"gate_scale and up_scale strides differ: {gate_scale.stride()} vs {up_scale.stride()}"
        )
    cfg = config or pick_fp8_moe_config(M * topk_ids.shape[1], E, block)
    if cfg.grouped:
        raise ValueError("the grouped GEMV is INT4's (kernels/fused_moe.py)")
    scale_bn, scale_bk, block_k = 1, 0, cfg.block_k
    if block is not None:
        scale_bn, scale_bk = block
        block_k = min(block_k, scale_bk)  # each K tile inside one scale block
    weights = ((w13, gate_scale, up_scale), (w2, down_scale, down_scale))
    consts = dict(SCALE_BN=scale_bn, SCALE_BK=scale_bk, BLOCK_N=cfg.block_n, BLOCK_K=block_k)

    def gemv(
        g: MoEGemm, split: int, flat_ids: torch.Tensor, topk_w: torch.Tensor, ws: torch.Tensor, cnt: torch.Tensor,
        blocks: Blocks | None,
    ) -> None:  # fmt: skip
        w, s, su = weights[g.which]
        _fused_moe_fp8_gemv_kernel[(flat_ids.numel(), triton.cdiv(g.N, cfg.block_n), split)](
            g.a, w, s, su, g.out, ws, cnt, topk_w, g.add if g.add is not None else g.out, flat_ids, E, g.N, g.K,
            *g.a.stride(), *w.stride(), *s.stride(), g.out.stride(0),
            A_ROW_DIV=g.a_row_div, TOP_K=topk_ids.shape[1], GATE_UP=g.gate_up, ADD=g.add is not None, **consts,
            **pdl_args(x.device), num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    def tiles(
        g: MoEGemm, sorted_ids: torch.Tensor, block_expert_ids: torch.Tensor, num_padded: torch.Tensor,
        topk_w: torch.Tensor,
    ) -> None:  # fmt: skip
        w, s, su = weights[g.which]
        _fused_moe_fp8_kernel[(block_expert_ids.numel() * triton.cdiv(g.N, cfg.block_n),)](
            g.a, w, s, su, g.out, topk_w, sorted_ids, block_expert_ids, num_padded, g.N, g.K, topk_w.numel(),
            *g.a.stride(), *w.stride(), *s.stride(), *g.out.stride(),
            A_ROW_DIV=g.a_row_div, GATE_UP=g.gate_up, MUL_WEIGHT=g.mul_weight, BLOCK_M=cfg.block_m, **consts,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl_args(x.device),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    return run_moe(x, topk_ids, topk_weights, E, I, cfg, gemv, tiles, add=add, local_share=local_share)


def fused_moe_fp8_ref(
    x: torch.Tensor,  # [M, H]
    topk_ids: torch.Tensor,  # [M, k] local expert ids; outside [0, E) contributes nothing
    topk_weights: torch.Tensor,  # [M, k]
    w13: torch.Tensor,  # [E, 2I, H] e4m3
    w2: torch.Tensor,  # [E, H, I] e4m3
    gate_scale: torch.Tensor,
    up_scale: torch.Tensor,
    down_scale: torch.Tensor,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """Pure torch in fp32: each used expert dequantized with its scales, SiLU-gated MLP, weighted sum."""
    E, I = w13.shape[0], w13.shape[1] // 2
    xf = x.to(torch.float32)
    out = torch.zeros_like(xf)  # [M, H]
    for e in torch.unique(topk_ids[(topk_ids >= 0) & (topk_ids < E)]).tolist():
        tok, slot = torch.where(topk_ids == e)
        gate = dequantize_fp8(w13[e, :I], gate_scale[e], block, torch.float32)  # [I, H]
        up = dequantize_fp8(w13[e, I:], up_scale[e], block, torch.float32)  # [I, H]
        down = dequantize_fp8(w2[e], down_scale[e], block, torch.float32)  # [H, I]
        h = torch.nn.functional.silu(xf[tok] @ gate.t()) * (xf[tok] @ up.t())  # [n, I]
        out.index_add_(0, tok, (h @ down.t()) * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)

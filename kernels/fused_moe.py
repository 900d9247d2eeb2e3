"""Fused MoE with INT4 (W4A16) routed experts: `out[t] = sum_j w[t, j] · down_e(silu(gate_e(x_t)) * up_e(x_t))`
with `e = ids[t, j]`, over the experts' packed checkpoint words (no dense copy of any expert).

Shape letters: M tokens, k experts per token, P = M·k (token, slot) pairs (pair p = token·k + slot),
E experts (local to this rank), H hidden, I expert intermediate, G group size, BM/BN/BK tiles.

Weights, as `backend.quant.experts.QuantExperts` holds them after load (the checkpoint's own
compressed-tensors layout fused per expert, read in place; `repack_int4`'s reasoning applies):
`w13 [E, 2I, H/8]` int32 (gate rows 0..I-1, up rows I..2I-1), `s13 [E, 2I, H/G]`,
`w2 [E, H, I/8]` int32, `s2 [E, H, I/G]`; nibble j of word i holds `q + 8` of element `8i + j`.

Tensor-core path (engine-anchors §2e; alignment, grids, split-K and k-sum in `kernels/moe_routing.py`,
shared with the FP8 experts' kernel `kernels/fused_moe_fp8.py`):
1. `moe_align` (`kernels/moe_align.py`, one launch): pairs sorted by expert (stable, so within an
   expert by token) into BM-padded groups; `block_expert_ids[b]` names block b's expert, -1 for the
   bucket of pairs whose expert is not on this rank (they contribute zeros).
2. `_fused_moe_kernel` with GATE_UP: per (expert block, N tile) the gate and up tiles of that
   expert are read once, dequantized in registers, two `tl.dot`s, `silu(g) * u` in the epilogue ->
   `act [P, I]`. Then `_fused_moe_kernel` again on `w2`, rows of `act`, routing weight applied ->
   `y [P, H]`.
3. `y.view(M, k, H).sum(1)`: a fixed-order reduction, so results are deterministic (no atomics).

Sparse decode (about one token per expert, `P <= E · GEMV_MAX_PAIRS_PER_EXPERT`): tensor-core tiles
would be mostly padding, so `_fused_moe_gemv_kernel` runs one program per (pair, N tile, K split) on
the CUDA cores with `kernels/triton_lib.py`'s dot products (one LOP3 and one FFMA per weight). It
reads the router's ids directly: no align step, two launches in all. Gate/up writes act as lifted
fp32 rows (the down GEMV's activation format, so down does no lifting); K splits and, for down, the
token's k slots meet in `moe_gemv_finish`, where the last program to arrive adds the fp32 partials in a
fixed order (deterministic) and writes act, or the token's output row. A pair routed to another
rank's expert (expert parallel: ids outside [0, E), read on the device, so no host sync) loads no
weights and takes no part there: no act row, no partial, no atomic; a token none of whose slots is
local gets zeros (the shared experts' `add`) from one program per N tile. Two pairs of one expert read
its weights twice, the second time mostly from L2, and unpack them twice: from a few pairs per expert
on, `_fused_moe_gemv_kernel` with GROUPED (`MoEConfig.grouped`) takes `moe_align` blocks of 2-8 pairs of one
expert and unpacks each word once for all of them; blocks of one pair (`block_m=1`) only put the pairs
in expert order, so those of one expert run side by side and the repeats read from L2. With `MoEConfig.loop_stages` > 1 the K loop is a
pipelined `tl.range`: Triton streams the word tiles through shared memory with cp.async, several in
flight per program, where the plain loop loads a tile and waits on it before unpacking (at M=1 the
plain loop's loads and its ~2.9 instructions per weight alternate instead of overlapping).

Tiles and the GEMV/tiles switch are `kernels/moe_routing.py`'s table, which
`benchmarks/kernels/bench_fused_moe.py --quick` measures the alternatives for.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.formats.int4 import dequantize_int4
from kernels.moe_routing import (
    GEMV_CONFIG,
    Blocks,
    MoEConfig,
    MoEGemm,
    check_routing,
    gemv_split_k,
    moe_align,
    pick_moe_config,
    run_moe,
)
from kernels.triton_lib import (
    LIFT_SCALE,
    MAGIC_2_23,
    group_dots,
    int4_tile_dot,
    lift_rows,
    load_int4_tile,
    moe_block_rows,
    moe_gemv_finish,
    moe_pair_expert,
    moe_tile_epilogue,
    pdl_args,
    pdl_enter,
    unpack_tile,
    x_planes,
)

__all__ = ["MoEConfig", "fused_moe", "fused_moe_ref", "gemv_split_k", "moe_align", "pick_moe_config"]


@triton.jit
def _load_b(
    w_ptr, s_ptr, rows, rows_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
    GROUP_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_ROWS: tl.constexpr,
):  # fmt: skip
    """K tile t of weight rows `rows`: words `[BN, BK/8]` int32 and per-word fp32 scales `[BN, BK/8]`.

    K8 = K/8 words and KG = K/G groups per row come in as arguments, not `K // 8`: the launcher's
    divisibility-by-16 specialization then reaches the masks, so a thread's 4 words load as one
    16-byte access (with `K // 8` the compiler only proves 2: 8-byte loads, checked in the PTX).
    """
    BK8: tl.constexpr = BLOCK_K // 8
    r = t * BK8 + tl.arange(0, BK8)
    wp = tl.load(
        w_ptr + rows[:, None] * stride_wn + r[None, :] * stride_wk,
        mask=rows_ok[:, None] & (r < K8)[None, :],
        other=0,
    )
    g = t * BLOCK_K // GROUP_SIZE + tl.arange(0, SCALE_ROWS)
    sc = tl.load(
        s_ptr + rows[:, None] * stride_sn + g[None, :] * stride_sg,
        mask=rows_ok[:, None] & (g < KG)[None, :],
        other=0.0,
    ).to(tl.float32)  # [BN, SR]
    BN: tl.constexpr = wp.shape[0]
    sc = tl.reshape(tl.broadcast_to(sc[:, :, None], (BN, SCALE_ROWS, BK8 // SCALE_ROWS)), (BN, BK8))
    return wp, sc


@triton.jit
def _fused_moe_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    topk_w_ptr,
    sorted_ids_ptr,
    block_expert_ids_ptr,
    num_padded_ptr,
    N,
    K,
    K8,  # K / 8 words per weight row
    KG,  # K / G groups per weight row
    num_pairs,
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_om,
    stride_on,
    magic_2_23,  # 0x4B000000 as a run-time value (one LOP3, see kernels/triton_lib.py)
    A_ROW_DIV: tl.constexpr,  # a row = pair // A_ROW_DIV: k for x (gate/up), 1 for act (down)
    GATE_UP: tl.constexpr,  # weight rows n and N + n, silu(gate) * up in the epilogue
    MUL_WEIGHT: tl.constexpr,  # scale each output row by its pair's routing weight
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE_ROWS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): the blocks are read after the wait
):
    """a [M or P, K], w [E, N or 2N, K/8] int32, s [E, N or 2N, K/G], out [P, N], topk_w [P],
    sorted_ids [num_blocks·BM] int32 (pair ids, padding = P), block_expert_ids [num_blocks] int32
    (-1: not on this rank), num_padded [1] int32; grid (num_blocks · cdiv(N, BN),)."""
    pdl_enter(PDL)
    expert, pair, m_ok, offs_n, n_ok, out_ptrs, out_mask = moe_block_rows(
        tl.program_id(0), N, num_pairs, sorted_ids_ptr, block_expert_ids_ptr, num_padded_ptr, out_ptr,
        stride_om, stride_on, GATE_UP, BLOCK_M, BLOCK_N,
    )  # fmt: skip
    if expert < 0:
        return
    w_e = w_ptr + expert.to(tl.int64) * stride_we
    s_e = s_ptr + expert.to(tl.int64) * stride_se
    a_rows = a_ptr + (pair // A_ROW_DIV).to(tl.int64) * stride_am
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for t in range(0, tl.cdiv(K, BLOCK_K)):
        kk = t * BLOCK_K + offs_k
        a = tl.load(
            a_rows[:, None] + kk[None, :] * stride_ak, mask=m_ok[:, None] & (kk < K)[None, :], other=0.0
        )
        wp, sc = _load_b(
            w_e, s_e, offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
            GROUP_SIZE, BLOCK_K, SCALE_ROWS,
        )  # fmt: skip
        b = unpack_tile(wp, sc, magic_2_23, a.dtype)  # [BN, BK]
        acc = tl.dot(a, tl.trans(b), acc, input_precision=DOT_PRECISION)
        if GATE_UP:
            wp, sc = _load_b(
                w_e, s_e, N + offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
                GROUP_SIZE, BLOCK_K, SCALE_ROWS,
            )  # fmt: skip
            b = unpack_tile(wp, sc, magic_2_23, a.dtype)
            acc_up = tl.dot(a, tl.trans(b), acc_up, input_precision=DOT_PRECISION)
    moe_tile_epilogue(acc, acc_up, topk_w_ptr, pair, m_ok, out_ptrs, out_mask, GATE_UP, MUL_WEIGHT)


@triton.jit
def _fused_moe_gemv_kernel(
    a_ptr,
    w_ptr,
    s_ptr,
    out_ptr,
    ws_ptr,
    cnt_ptr,
    topk_w_ptr,
    add_ptr,  # ADD: [M, N] added to down's rows (out's strides), else a placeholder
    ids_ptr,  # topk_ids [P] int32/int64, or GROUPED: moe_align's sorted_ids [blocks · BM]
    topk_ids_ptr,  # [P] int32/int64: which of a token's slots are local (the down finish)
    block_expert_ids_ptr,  # GROUPED: moe_align's [blocks] (else unused)
    num_padded_ptr,  # GROUPED: moe_align's [1] (else unused)
    num_experts,
    num_pairs,
    N,
    K8,  # K / 8 words per weight row
    KG,  # K / G groups per weight row
    stride_am,
    stride_ak,
    stride_we,
    stride_wn,
    stride_wk,
    stride_se,
    stride_sn,
    stride_sg,
    stride_om,
    A_ROW_DIV: tl.constexpr,  # a row = pair // A_ROW_DIV: k for x (gate/up), 1 for act (down)
    TOP_K: tl.constexpr,
    GATE_UP: tl.constexpr,
    LIFTED: tl.constexpr,  # a holds lifted rows (`kernels/triton_lib.py`): act always, x with cfg.lift
    GROUPED: tl.constexpr,  # a program per block of BLOCK_M pairs of one expert (LIFTED)
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,  # 1 unless GROUPED
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_K: tl.constexpr,  # K % BLOCK_K == 0
    EVEN_N: tl.constexpr,  # N % BLOCK_N == 0
    LOOP_STAGES: tl.constexpr,  # >1: the K loop pipelined (cp.async word tiles in flight), 1: plain
    ADD: tl.constexpr,  # down: add's rows added to the finished sums (`moe_gemv_finish`)
    PDL: tl.constexpr,  # launched with PDL: nothing before the wait (the experts are the router's output)
):
    """Sparse decode: a [M, H] x or [P, lifted I] act, w/s as `_fused_moe_kernel` (G >= 32), topk_w
    [P]; grid (P or blocks, cdiv(N, BN), splits of K). Per pair (topk_ids outside [0, E): not on this
    rank) the pair axis runs fastest, so pairs of one expert read each N tile at about the same time
    (the repeats from L2); GROUPED, each K tile's words are unpacked once for the block's pairs
    (`group_dots`; padding pairs are num_pairs, a block of expert -1 another rank's pairs). out:
    GATE_UP: act [P, lifted N] fp32; else [M, N], the k-sum done (`moe_gemv_finish`, with the fp32
    workspace ws and the counters cnt)."""
    pdl_enter(PDL)
    if GROUPED:
        blk = tl.program_id(0)
        if blk * BLOCK_M >= tl.load(num_padded_ptr):
            return  # a block past the used ones: only padding
        expert = tl.load(block_expert_ids_ptr + blk)
        is_local = expert >= 0  # -1: another rank's pairs, which down still adds (as zeros)
        expert = tl.where(is_local, expert, 0).to(tl.int64)
        pairs = ()
        for i in tl.static_range(BLOCK_M):
            pairs = pairs + (tl.load(ids_ptr + blk * BLOCK_M + i),)
    else:
        pairs = (tl.program_id(0),)
        expert, is_local = moe_pair_expert(pairs[0], num_experts, ids_ptr)
    x_rows = ()  # a padding pair (num_pairs) reads its block's first pair, a row its expert wrote (another
    for i in tl.static_range(BLOCK_M):  # rank's pairs' act rows are never written: garbage, maybe NaN)
        row = tl.where(pairs[i] < num_pairs, pairs[i], pairs[0]) // A_ROW_DIV
        x_rows = x_rows + (a_ptr + row.to(tl.int64) * stride_am,)
    BK8: tl.constexpr = BLOCK_K // 8
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w_e = w_ptr + expert * stride_we
    s_e = s_ptr + expert * stride_se
    k_tiles = tl.cdiv(K8, BK8)
    per_split = tl.cdiv(k_tiles, tl.num_programs(2))
    t0 = tl.program_id(2) * per_split
    t1 = tl.where(is_local, tl.minimum(t0 + per_split, k_tiles), t0)  # another rank's pairs: no K loop
    NUM_ACC: tl.constexpr = 2 * BLOCK_M if GATE_UP else BLOCK_M  # [C, BN] per pair: gate (or down), up
    accs = ()
    for _ in tl.static_range(NUM_ACC):
        accs = accs + (tl.zeros((BLOCK_K // 32, BLOCK_N), dtype=tl.float32),)
    for t in tl.range(t0, t1, num_stages=LOOP_STAGES):
        r = t * BK8 + tl.arange(0, BK8)
        if GROUPED:
            wp, sc = load_int4_tile(
                w_e, s_e, offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
                GROUP_SIZE, BLOCK_K, EVEN_K, EVEN_N,
            )  # fmt: skip
            ds = group_dots(wp, sc, x_rows, r, r < K8, EVEN_K)
            if GATE_UP:
                wp, sc = load_int4_tile(
                    w_e, s_e, N + offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
                    GROUP_SIZE, BLOCK_K, EVEN_K, EVEN_N,
                )  # fmt: skip
                ds = ds + group_dots(wp, sc, x_rows, r, r < K8, EVEN_K)
        else:
            ys, xs = x_planes(x_rows[0], r, r < K8, stride_ak, LIFTED, EVEN_K)  # shared by gate and up
            ds = (
                int4_tile_dot(
                    w_e, s_e, offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg, ys, xs,
                    GROUP_SIZE, BLOCK_K, LIFTED, EVEN_K, EVEN_N,
                ),
            )  # fmt: skip
            if GATE_UP:
                ds = ds + (
                    int4_tile_dot(
                        w_e, s_e, N + offs_n, n_ok, t, K8, KG, stride_wn, stride_wk, stride_sn, stride_sg,
                        ys, xs, GROUP_SIZE, BLOCK_K, LIFTED, EVEN_K, EVEN_N,
                    ),
                )  # fmt: skip
        nxt = ()
        for i in tl.static_range(NUM_ACC):
            nxt = nxt + (accs[i] + ds[i],)
        accs = nxt
    for i in tl.static_range(BLOCK_M):
        if pairs[i] < num_pairs:
            moe_gemv_finish(
                tl.sum(accs[i], axis=0) * LIFT_SCALE, tl.sum(accs[(BLOCK_M + i) % NUM_ACC], axis=0) * LIFT_SCALE,
                pairs[i], is_local, offs_n, n_ok, N, out_ptr, stride_om, ws_ptr, cnt_ptr, topk_w_ptr, add_ptr,
                topk_ids_ptr, num_experts, GATE_UP, GATE_UP, TOP_K, ADD,
            )  # fmt: skip


def _check_weights(
    w: torch.Tensor, s: torch.Tensor, E: int, N: int, K: int, group_size: int, name: str
) -> None:
    if w.dtype != torch.int32 or tuple(w.shape) != (E, N, K // 8):
        raise ValueError(f"{name} packed must be int32 [{E}, {N}, {K // 8}], got {w.dtype} {tuple(w.shape)}")
    if not s.is_floating_point() or tuple(s.shape) != (E, N, K // group_size):
        raise ValueError(f"{name} scales must be float [{E}, {N}, {K // group_size}], got {tuple(s.shape)}")
    if w.stride(-1) != 1:
        raise ValueError(f"{name} packed words must be contiguous along K (stride {w.stride()})")


def fused_moe(
    x: torch.Tensor,  # [M, H] fp16 / bf16 / fp32
    topk_ids: torch.Tensor,  # [M, k] int, local expert ids (outside [0, E): another rank's, skipped)
    topk_weights: torch.Tensor,  # [M, k] float (routed scaling already folded in, as Router returns)
    w13: torch.Tensor,  # [E, 2I, H/8] int32
    s13: torch.Tensor,  # [E, 2I, H/G]
    w2: torch.Tensor,  # [E, H, I/8] int32
    s2: torch.Tensor,  # [E, H, I/G]
    group_size: int,
    config: MoEConfig | None = None,
    add: torch.Tensor | None = None,  # [M, H] x's dtype, contiguous: added to the sum (the shared experts)
    local_share: float = 1.0,  # expert parallel: E local / E in all (`run_moe` sizes the GEMV's splits)
) -> torch.Tensor:
    """`sum_j w[:, j] · down(silu(gate(x)) * up(x))` over each token's experts (`+ add`, the sum rounded
    to x's dtype first, as torch adds two tensors); [M, H] in x's dtype."""
    check_routing(x, topk_ids, topk_weights, w13, s13, w2, s2)
    if group_size % 8 or group_size & (group_size - 1):
        raise ValueError(f"group_size must be a power of two and a multiple of 8, got {group_size}")
    M, H = x.shape
    E, I2 = w13.shape[0], w13.shape[1]
    I = I2 // 2
    if I2 % 2 or H % group_size or I % group_size:
        raise ValueError(f"H={H} and I={I} must be multiples of the group size {group_size}")
    _check_weights(w13, s13, E, 2 * I, H, group_size, "w13")
    _check_weights(w2, s2, E, H, I, group_size, "w2")
    cfg = config or pick_moe_config(M * topk_ids.shape[1], E, GEMV_CONFIG if group_size >= 32 else None)
    is_gemv = cfg.block_m == 0 or cfg.grouped
    if is_gemv and (
        group_size < 32 or cfg.block_k % 32 or cfg.block_n % 32 or (cfg.grouped and not cfg.lift)
    ):
        raise ValueError(
            f"the GEMV needs group_size >= 32, tiles in multiples of 32 (grouped: lift), got {group_size}, {cfg}"
        )
    weights = ((w13, s13), (w2, s2))
    scale_rows = max(cfg.block_k // group_size, 1)

    def gemv(
        g: MoEGemm, split: int, flat_ids: torch.Tensor, topk_w: torch.Tensor, ws: torch.Tensor, cnt: torch.Tensor,
        blocks: Blocks | None,
    ) -> None:  # fmt: skip
        w, s = weights[g.which]
        a = lift_rows(g.a) if g.gate_up and cfg.lift else g.a
        ids = blocks or (flat_ids, flat_ids, flat_ids)  # the grouped kernel's blocks, or the pairs' ids
        _fused_moe_gemv_kernel[(ids[1].numel(), triton.cdiv(g.N, cfg.block_n), split)](
            a, w, s, g.out, ws, cnt, topk_w, g.add if g.add is not None else g.out, ids[0], flat_ids, *ids[1:], E,
            flat_ids.numel(), g.N, g.K // 8, g.K // group_size,
            *a.stride(), *w.stride(), *s.stride(), g.out.stride(0),
            A_ROW_DIV=g.a_row_div, TOP_K=topk_ids.shape[1], GATE_UP=g.gate_up, LIFTED=not g.gate_up or cfg.lift,
            GROUPED=blocks is not None, GROUP_SIZE=group_size, BLOCK_M=cfg.block_m if blocks else 1,
            BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=g.K % cfg.block_k == 0, EVEN_N=g.N % cfg.block_n == 0,
            LOOP_STAGES=cfg.loop_stages, ADD=g.add is not None, **pdl_args(x.device), num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )  # fmt: skip

    def tiles(
        g: MoEGemm, sorted_ids: torch.Tensor, block_expert_ids: torch.Tensor, num_padded: torch.Tensor,
        topk_w: torch.Tensor,
    ) -> None:  # fmt: skip
        w, s = weights[g.which]
        _fused_moe_kernel[(block_expert_ids.numel() * triton.cdiv(g.N, cfg.block_n),)](
            g.a, w, s, g.out, topk_w, sorted_ids, block_expert_ids, num_padded, g.N, g.K, g.K // 8,
            g.K // group_size, topk_w.numel(), *g.a.stride(), *w.stride(), *s.stride(), *g.out.stride(), MAGIC_2_23,
            A_ROW_DIV=g.a_row_div, GATE_UP=g.gate_up, MUL_WEIGHT=g.mul_weight, GROUP_SIZE=group_size,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE_ROWS=scale_rows,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32", **pdl_args(x.device),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )  # fmt: skip

    return run_moe(
        x, topk_ids, topk_weights, E, I, cfg, gemv, tiles, lifted_act=True, add=add, local_share=local_share
    )


def fused_moe_ref(
    x: torch.Tensor,  # [M, H]
    topk_ids: torch.Tensor,  # [M, k] local expert ids; outside [0, E) contributes nothing
    topk_weights: torch.Tensor,  # [M, k]
    w13: torch.Tensor,  # [E, 2I, H/8] int32, checkpoint layout
    s13: torch.Tensor,  # [E, 2I, H/G]
    w2: torch.Tensor,  # [E, H, I/8] int32
    s2: torch.Tensor,  # [E, H, I/G]
    group_size: int,
) -> torch.Tensor:
    """Pure torch in fp32: each used expert dequantized from its words, SiLU-gated MLP, weighted sum."""
    E, I = w13.shape[0], w13.shape[1] // 2
    xf = x.to(torch.float32)
    out = torch.zeros_like(xf)  # [M, H]
    for e in torch.unique(topk_ids[(topk_ids >= 0) & (topk_ids < E)]).tolist():
        tok, slot = torch.where(topk_ids == e)
        gu = dequantize_int4(w13[e], s13[e], 8 * w13.shape[2], group_size, torch.float32)  # [2I, H]
        down = dequantize_int4(w2[e], s2[e], 8 * w2.shape[2], group_size, torch.float32)  # [H, I]
        h = xf[tok] @ gu.t()  # [n, 2I]
        y = (torch.nn.functional.silu(h[:, :I]) * h[:, I:]) @ down.t()  # [n, H]
        out.index_add_(0, tok, y * topk_weights[tok, slot, None].float())
    return out.to(x.dtype)

"""What the fused MoE kernels share whatever the weight format (INT4 `kernels/fused_moe.py`, FP8
`kernels/fused_moe_fp8.py`): input checks, tile configs, the token→expert alignment, and the driver
that runs the two GEMMs (gate+up with SiLU·mul, then down with the routing weights) and the k-sum.

Shape letters: M tokens, k experts per token, P = M·k (token, slot) pairs (pair p = token·k + slot),
E experts (local to this rank), H hidden, I expert intermediate, BM/BN/BK tiles.

A format supplies two launch callbacks, one per kernel family, each called once per GEMM:
- sparse decode (`block_m == 0`, or INT4's `grouped`): `gemv(g, split, flat_ids, topk_w, ws, cnt,
  blocks)`, grid (P or blocks, cdiv(N, BN), split), ending in `moe_gemv_finish` (split-K and the k-sum
  inside the kernels: two launches in all, three with INT4's `lift`, plus `moe_align` when grouped);
- tensor-core tiles: `tiles(g, sorted_ids, block_expert_ids, num_padded, topk_w)`, grid
  (num_blocks · cdiv(N, BN),), blocks from `moe_align`.
Nothing here syncs with the host, so a decode step that calls it can be captured in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton

from kernels.moe_align import moe_align
from kernels.split_k_merge import num_sms, split_k_counters
from kernels.triton_lib import lifted_width

__all__ = ["MoEConfig", "MoEGemm", "check_routing", "gemv_split_k", "moe_align", "pick_moe_config", "run_moe"]


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Tiles of both GEMMs; `block_m == 0` selects the sparse-decode GEMV kernel, whose K is split
    `split_k` ways (0: per GEMM, by `gemv_split_k` at `programs_per_sm`, 0: `GEMV_PROGRAMS_PER_SM`);
    `lift` (INT4 GEMV) lifts x in a launch before gate/up instead of in every program
    (`kernels/triton_lib.py`); `grouped` (INT4, with `lift`) runs the GEMV once per block of
    `block_m` pairs of one expert, unpacking its words once for all of them."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0
    programs_per_sm: int = 0
    lift: bool = False
    grouped: bool = False  # INT4: the GEMV over `moe_align` blocks of block_m pairs of one expert
    # INT4 GEMV: >1 pipelines its K loop (`tl.range` stages: word tiles in flight through cp.async)
    loop_stages: int = 1


# Launcher defaults, from `bench_fused_moe --quick` on the H200 (update from its printed table): the
# INT4 GEMV's tiles, the programs per SM its split-K aims for, the pairs per expert up to which it
# runs; then by pairs per expert the grouped GEMV (INT4; none until measured) and the tiles.
# (the activation lift off: 0.93-0.95 of the time with it on at M=1, H200 2026-12-01)
GEMV_CONFIG = MoEConfig(block_m=0, block_n=64, block_k=256)
GEMV_PROGRAMS_PER_SM = 12  # several waves: a last wave of a few programs runs latency-bound
GEMV_MAX_PAIRS_PER_EXPERT = (
    2.0  # Kimi and GLM-5 at M=64 (1.3, 2.0): 2.6x fewer instructions than the old GEMV
)
GROUPED_CONFIGS: tuple[tuple[float, MoEConfig], ...] = ()  # (largest pairs per expert, grouped GEMV)
TILE_CONFIGS = (  # (largest pairs per expert, tiles)
    (16.0, MoEConfig(block_m=16, block_n=64, block_k=128, num_stages=4)),
    (32.0, MoEConfig(block_m=32, block_n=32, block_k=128, num_stages=4)),
    (float("inf"), MoEConfig(block_m=64, block_n=64, block_k=128, num_stages=3)),  # W4A16's best at M=64
)


def pick_moe_config(
    num_pairs: int,
    num_experts: int,
    gemv: MoEConfig | None = GEMV_CONFIG,
    grouped: tuple[tuple[float, MoEConfig], ...] = GROUPED_CONFIGS,
    gemv_max: float = GEMV_MAX_PAIRS_PER_EXPERT,
) -> MoEConfig:
    """By tokens per expert `P / E`: the GEMV (`gemv`, the format's tiles; None: it cannot run) up
    to `gemv_max`, else the first of `grouped` (the format's; () for none), then of `TILE_CONFIGS`,
    whose bound holds (a BM a typical expert block fills)."""
    per_expert = num_pairs / num_experts
    if gemv is not None and per_expert <= gemv_max:
        return gemv
    return next(cfg for bound, cfg in (*(grouped if gemv else ()), *TILE_CONFIGS) if per_expert <= bound)


def gemv_split_k(num_pairs: int, N: int, K: int, cfg: MoEConfig, num_sms: int) -> int:
    """Split K until there are about `cfg.programs_per_sm` (4-warp) programs per SM: at one token,
    Kimi's gate/up GEMV has only 8 · I/BN programs, too few loads in flight to cover HBM latency, and
    several waves of short programs leave a smaller tail than one of long ones. At most 16 splits of
    2+ K tiles each, every split with work."""
    target = (cfg.programs_per_sm or GEMV_PROGRAMS_PER_SM) * num_sms * 4 // cfg.num_warps
    programs = num_pairs * triton.cdiv(N, cfg.block_n)
    k_tiles = triton.cdiv(K, cfg.block_k)
    split = max(1, min(k_tiles // 2, round(target / programs), 16))
    return triton.cdiv(k_tiles, triton.cdiv(k_tiles, split))  # no split left without a K tile


def check_routing(
    x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *weights: torch.Tensor
) -> None:
    """The launchers' shared checks: x 2-D float, ids/weights [M, k], everything on one device."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32) or x.dim() != 2:
        raise TypeError(f"x must be 2-D fp16, bf16 or fp32, got {x.dtype} {tuple(x.shape)}")
    M = x.shape[0]
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != M:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights must both be [{M}, k]")
    if topk_ids.dtype.is_floating_point or not topk_weights.is_floating_point():
        raise TypeError("topk_ids must be integer and topk_weights float")
    if len({t.device for t in (x, topk_ids, topk_weights, *weights)}) != 1:
        raise ValueError("all tensors must be on one device")


@dataclass(frozen=True, slots=True)
class MoEGemm:
    """One of the two GEMMs: `out = f(a rows) · w[expert]ᵀ` over K (`which` 0: gate+up, 1: down)."""

    which: int
    a: torch.Tensor  # [M, H] x (gate/up), [P, I] act (down; lifted rows for the INT4 GEMV)
    out: torch.Tensor  # [P, N] act; down: [P, N] y (tiles) or [M, N], the k-sum done (GEMV)
    N: int
    K: int
    a_row_div: int  # a row = pair // a_row_div: k for x, 1 for act
    gate_up: bool  # weight rows n and N + n, silu(gate) * up in the epilogue
    mul_weight: bool  # scale each output row by its pair's routing weight
    add: torch.Tensor | None = None  # down, GEMV: [M, N] added to the finished rows (out's strides)


# gemv(g, split, flat_ids [P], topk_w [P], ws fp32, cnt int32, blocks): grid (P or blocks, cdiv(N, BN),
# split), ends in `moe_gemv_finish`; blocks: `moe_align`'s output for `grouped`, else None;
# tiles(g, sorted_ids, block_expert_ids, num_padded, topk_w): grid (blocks · N tiles,)
Blocks = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
GemvLaunch = Callable[
    [MoEGemm, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, Blocks | None], None
]
TilesLaunch = Callable[[MoEGemm, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def run_moe(
    x: torch.Tensor,  # [M, H]
    topk_ids: torch.Tensor,  # [M, k]
    topk_weights: torch.Tensor,  # [M, k]
    num_experts: int,
    inter: int,
    cfg: MoEConfig,
    gemv: GemvLaunch,
    tiles: TilesLaunch,
    lifted_act: bool = False,  # the GEMV's act in `kernels/triton_lib.py`'s lifted rows (INT4)
    add: torch.Tensor | None = None,  # [M, H] x's dtype: added to the routed sum
    local_share: float = 1.0,  # the expected share of pairs whose expert is on this rank (E_local / E)
) -> torch.Tensor:
    """Both GEMMs through the format's kernels and the k-sum in a fixed order (deterministic, no
    float atomics): in the GEMV's down epilogue (two launches in all, `add` added there too), after
    the tiles by torch (then `add` by torch). The GEMV's K splits are sized for the pairs expected
    here (`local_share` of them, at least one): under expert parallelism the other ranks' pairs'
    programs load nothing, and splits sized for all pairs left ~1 local pair of 8 (GLM 5.2 at one rank
    of 8) on an eighth of the GPU (H100, 2026-12-06: 13 us a call, ~0.25 of copy)."""
    M, H = x.shape
    k = topk_ids.shape[1]
    P, I = M * k, inter
    if add is not None and (add.shape != x.shape or add.dtype != x.dtype):
        raise ValueError(f"add must be {x.dtype} {tuple(x.shape)}, got {add.dtype} {tuple(add.shape)}")
    add = add.contiguous() if add is not None else None  # the epilogue reads it with out's strides
    if P == 0:
        return torch.zeros_like(x) if add is None else add.clone()
    topk_w = topk_weights.reshape(-1).contiguous()  # [P]
    if cfg.block_m == 0 or cfg.grouped:  # decode: a few pairs per expert; no torch op between
        flat_ids = topk_ids.reshape(-1).contiguous()  # [P]
        blocks = moe_align(topk_ids, num_experts, cfg.block_m) if cfg.grouped else None
        act_shape, act_dtype = ((P, lifted_width(I)), torch.float32) if lifted_act else ((P, I), x.dtype)
        act = torch.empty(act_shape, dtype=act_dtype, device=x.device)
        out = torch.empty((M, H), dtype=x.dtype, device=x.device)
        rows = triton.cdiv(P, cfg.block_m) if cfg.grouped else P  # programs along the first grid axis, about
        for g in (MoEGemm(0, x, act, I, H, k, True, False), MoEGemm(1, act, out, H, I, 1, False, True, add)):
            expected = max(1, round(rows * local_share))  # rows whose expert is here, about
            split = cfg.split_k or gemv_split_k(expected, g.N, g.K, cfg, num_sms(x.device))
            arrivals = split if g.gate_up else k * split
            ws_shape = (P, split, 2 * g.N if g.gate_up else g.N) if arrivals > 1 else (1,)
            ws = torch.empty(ws_shape, dtype=torch.float32, device=x.device)
            cnt = split_k_counters(x.device, (P if g.gate_up else M) * triton.cdiv(g.N, cfg.block_n))
            gemv(g, split, flat_ids, topk_w, ws, cnt, blocks)
        return out
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)
    sorted_ids, block_expert_ids, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
    for g in (MoEGemm(0, x, act, I, H, k, True, False), MoEGemm(1, act, y, H, I, 1, False, True)):
        tiles(g, sorted_ids, block_expert_ids, num_padded, topk_w)
    routed = y.view(M, k, H).sum(dim=1)  # fixed-order reduction over each token's k slots
    return routed if add is None else routed + add

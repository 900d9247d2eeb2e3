"""What the fused MoE kernels share whatever the weight format (INT4 `kernels/fused_moe.py`, FP8
`kernels/fused_moe_fp8.py`): input checks, tile configs, the token→expert alignment, and the driver
that runs the two GEMMs (gate+up with SiLU·mul, then down with the routing weights) and the k-sum.

Shape letters: M tokens, k experts per token, P = M·k (token, slot) pairs (pair p = token·k + slot),
E experts (local to this rank), H hidden, I expert intermediate, BM/BN/BK tiles.

A format supplies two launch callbacks, one per kernel family, each called once per GEMM:
- sparse decode (`block_m == 0`): `gemv(g, dst, split, flat_ids, topk_w)`, grid (P, cdiv(N, BN),
  split); `dst` is `g.out` when `split == 1`, else an fp32 workspace [split, P, 2N (gate | up) or N];
- tensor-core tiles: `tiles(g, sorted_ids, block_expert_ids, num_padded, topk_w)`, grid
  (num_blocks · cdiv(N, BN),), blocks from `moe_align`.
Everything here is torch ops without a host sync, so a decode step that calls it can be captured
in a CUDA graph.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from kernels.split_k_merge import num_sms

__all__ = ["MoEConfig", "MoEGemm", "check_routing", "gemv_split_k", "moe_align", "pick_moe_config", "run_moe"]


@triton.jit
def _silu(g):
    """`g · sigmoid(g)` from `exp(-|g|)`: no overflow for large |g| (fp32)."""
    e = tl.exp(-tl.abs(g))
    return g * tl.where(g >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _block_rows(pid, N, num_pairs, sorted_ids_ptr, block_expert_ids_ptr, num_padded_ptr, out_ptr, stride_om, stride_on,
                GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
    """Tile kernels: program pid's (expert block, N tile) -> (expert, pair [BM], m_ok, offs_n [BN], n_ok,
    out_ptrs [BM, BN], out_mask). expert < 0: nothing to compute (a block past the used ones, or the
    pairs routed to another rank: their act rows are never read, their y rows are zeroed here)."""
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n  # the N tiles of one block run side by side: its A rows stay in L2
    pid_n = pid % num_pid_n
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_ids_ptr + offs_m)  # [BM]
    m_ok = pair < num_pairs
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    out_ptrs = out_ptr + pair[:, None].to(tl.int64) * stride_om + offs_n[None, :] * stride_on
    out_mask = m_ok[:, None] & n_ok[None, :]
    expert = tl.load(block_expert_ids_ptr + pid_m)
    expert = tl.where(pid_m * BLOCK_M >= tl.load(num_padded_ptr), -2, expert)  # past the used blocks
    if not GATE_UP:  # noqa: SIM102 (a constexpr: gate/up compiles no store)
        if expert == -1:
            tl.store(out_ptrs, tl.zeros((BLOCK_M, BLOCK_N), dtype=out_ptr.dtype.element_ty), mask=out_mask)
    return expert, pair, m_ok, offs_n, n_ok, out_ptrs, out_mask


@triton.jit
def _tile_epilogue(acc, acc_up, topk_w_ptr, pair, m_ok, out_ptrs, out_mask,
                   GATE_UP: tl.constexpr, MUL_WEIGHT: tl.constexpr):  # fmt: skip
    """acc / acc_up [BM, BN] fp32 -> out: silu(gate) * up for GATE_UP, the routing weight for MUL_WEIGHT."""
    if GATE_UP:
        acc = _silu(acc) * acc_up
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=out_mask)


@triton.jit
def _pair_rows(pair, num_experts, N, topk_ids_ptr, out_ptr, stride_os, stride_om, stride_on,
               GATE_UP: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """GEMV kernels (grid (P, N tiles, K splits)): (expert, offs_n [BN], n_ok, out_ptrs) of this program;
    expert -1 for a pair of another rank (outside [0, E)), whose output, both halves of a gate | up
    split workspace, is zeroed here."""
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    out_ptrs = out_ptr + tl.program_id(2) * stride_os + pair.to(tl.int64) * stride_om + offs_n * stride_on
    expert = tl.load(topk_ids_ptr + pair)
    is_other_rank = (expert < 0) | (expert >= num_experts)
    if is_other_rank:
        tl.store(out_ptrs, tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=n_ok)
        if GATE_UP and SPLIT_K > 1:
            tl.store(
                out_ptrs + N * stride_on, tl.zeros((BLOCK_N,), dtype=out_ptr.dtype.element_ty), mask=n_ok
            )
    return tl.where(is_other_rank, -1, expert), offs_n, n_ok, out_ptrs  # ids may be int32 or int64


@triton.jit
def _gemv_epilogue(acc, acc_up, topk_w_ptr, pair, out_ptrs, n_ok, N, stride_on,
                   GATE_UP: tl.constexpr, MUL_WEIGHT: tl.constexpr, SPLIT_K: tl.constexpr):  # fmt: skip
    """acc / acc_up [BN] fp32 sums -> out: finished (SiLU·mul, routing weight) with SPLIT_K == 1; else
    this split's partials (gate | up side by side for GATE_UP, the routing weight applied to down's)."""
    if GATE_UP:
        if SPLIT_K == 1:
            acc = _silu(acc) * acc_up
        else:
            tl.store(out_ptrs + N * stride_on, acc_up, mask=n_ok)
    if MUL_WEIGHT:
        acc = acc * tl.load(topk_w_ptr + pair).to(tl.float32)
    tl.store(out_ptrs, acc.to(out_ptrs.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True, slots=True)
class MoEConfig:
    """Tiles of both GEMMs; `block_m == 0` selects the sparse-decode GEMV kernel, whose K is split
    `split_k` ways (0: per GEMM, by `gemv_split_k`)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    split_k: int = 0


def pick_moe_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """By tokens per expert `P / E`: GEMV at about one, else a BM that a typical expert block fills.

    (Heuristic from vLLM's int4 defaults and the W4A16 GEMM's H200 runs; `bench_fused_moe` times the
    alternatives beside it. Registers gate/up | down from an offline sm_90a compile with the launch's
    specializations: GEMV 80 | 64, BM 16: 128 | 96, BM 32: 139 | 102, BM 64 (wgmma): 190 | 109; no spills.)
    """
    per_expert = num_pairs / num_experts
    if per_expert <= 1:
        return MoEConfig(block_m=0, block_n=32, block_k=128)
    if per_expert <= 16:
        return MoEConfig(block_m=16, block_n=64, block_k=128, num_stages=4)
    if per_expert <= 32:
        return MoEConfig(block_m=32, block_n=32, block_k=128, num_stages=4)
    return MoEConfig(block_m=64, block_n=64, block_k=128, num_stages=3)  # W4A16's best tiles at M=64


def gemv_split_k(num_pairs: int, N: int, K: int, cfg: MoEConfig, num_sms: int) -> int:
    """Split K until there are about 8 programs per SM (at 79-128 registers, 6+ fit): at one token,
    Kimi's gate/up GEMV has 8 · 64 programs, too few loads in flight to cover HBM latency. At most 16
    splits of 4+ K tiles each."""
    programs = num_pairs * triton.cdiv(N, cfg.block_n)
    return max(1, min(triton.cdiv(K, cfg.block_k) // 4, (8 * num_sms) // programs, 16))


def moe_align(
    expert_ids: torch.Tensor,  # [M, k] int, local expert ids; outside [0, E) = not on this rank
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pairs grouped by expert into BM-padded blocks, with torch ops and no host sync.

    Returns `sorted_ids [num_blocks·BM]` int32 (pair ids `token·k + slot`, each expert's run padded
    with P up to a multiple of BM), `block_expert_ids [num_blocks]` int32 (-1 for the bucket of pairs
    not on this rank and for blocks past the end) and `num_padded [1]` int32 (blocks in use · BM).
    `num_blocks = min(cdiv(P + (E+1)(BM-1), BM), P)` is known on the host: a bucket of c pairs takes
    at most c blocks. The sort is stable, so within an expert pairs keep token order.
    """
    E, BM = num_experts, block_m
    flat = expert_ids.reshape(-1).to(torch.int64)  # [P]
    P = flat.numel()
    dev = flat.device
    bucket = torch.where((flat >= 0) & (flat < E), flat, E)  # [P], E = not on this rank
    sorted_bucket, order = torch.sort(bucket, stable=True)  # [P]
    bounds = torch.searchsorted(sorted_bucket, torch.arange(E + 2, device=dev))  # [E+2] run starts
    counts = bounds[1:] - bounds[:-1]  # [E+1]
    padded_end = torch.cumsum((counts + BM - 1) // BM * BM, 0)  # [E+1]
    padded_start = padded_end - (counts + BM - 1) // BM * BM
    dest = padded_start[sorted_bucket] + torch.arange(P, device=dev) - bounds[sorted_bucket]  # [P]
    num_blocks = max(1, min(triton.cdiv(P + (E + 1) * (BM - 1), BM), P))
    sorted_ids = torch.full((num_blocks * BM,), P, dtype=torch.int32, device=dev)
    sorted_ids[dest] = order.to(torch.int32)
    block_bucket = torch.searchsorted(padded_end, torch.arange(num_blocks, device=dev) * BM, right=True)
    block_expert_ids = torch.where(block_bucket < E, block_bucket, -1).to(torch.int32)
    return sorted_ids, block_expert_ids, padded_end[-1:].to(torch.int32)


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
    """One of the two GEMMs: `out [P, N] = f(a rows) · w[expert]ᵀ` over K (`which` 0: gate+up, 1: down)."""

    which: int
    a: torch.Tensor  # [M, H] x (gate/up) or [P, I] act (down)
    out: torch.Tensor  # [P, N]
    N: int
    K: int
    a_row_div: int  # a row = pair // a_row_div: k for x, 1 for act
    gate_up: bool  # weight rows n and N + n, silu(gate) * up in the epilogue
    mul_weight: bool  # scale each output row by its pair's routing weight


GemvLaunch = Callable[[MoEGemm, torch.Tensor, int, torch.Tensor, torch.Tensor], None]
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
) -> torch.Tensor:
    """Both GEMMs through the format's kernels, then the fixed-order k-sum (deterministic, no atomics)."""
    M, H = x.shape
    k = topk_ids.shape[1]
    P, I = M * k, inter
    if P == 0:
        return torch.zeros_like(x)
    topk_w = topk_weights.reshape(-1).contiguous()  # [P]
    act = torch.empty((P, I), dtype=x.dtype, device=x.device)
    y = torch.empty((P, H), dtype=x.dtype, device=x.device)
    gemms = (MoEGemm(0, x, act, I, H, k, True, False), MoEGemm(1, act, y, H, I, 1, False, True))
    if cfg.block_m == 0:  # decode: about one pair per expert
        flat_ids = topk_ids.reshape(-1).contiguous()  # [P]: no align step, no torch op before the kernels
        for g in gemms:
            split = cfg.split_k or gemv_split_k(P, g.N, g.K, cfg, num_sms(x.device))
            # split K: fp32 partials [S, P, 2N or N], added in a fixed order below (deterministic)
            dst = (
                g.out
                if split == 1
                else torch.empty(
                    (split, P, 2 * g.N if g.gate_up else g.N), device=x.device, dtype=torch.float32
                )
            )
            gemv(g, dst, split, flat_ids, topk_w)
            if split > 1 and g.gate_up:
                gu = dst.sum(dim=0)  # [P, 2I] fp32
                act.copy_(F.silu(gu[:, :I]) * gu[:, I:])
            elif split > 1:  # the k-sum and the split sum in one fixed-order reduction
                return dst.view(split, M, k, H).sum(dim=(0, 2)).to(x.dtype)
    else:
        sorted_ids, block_expert_ids, num_padded = moe_align(topk_ids, num_experts, cfg.block_m)
        for g in gemms:
            tiles(g, sorted_ids, block_expert_ids, num_padded, topk_w)
    return y.view(M, k, H).sum(dim=1)  # fixed-order reduction over each token's k slots

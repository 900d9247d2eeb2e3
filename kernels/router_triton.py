"""`noaux_tc` routing in one launch, a program per token; the op and its reference are
`kernels/router.py`. The k experts are chosen one at a time (the best biased score, the lowest id
among equals), as are the groups; everything stays in registers.

Shapes: T tokens, E experts (BLOCK_E lanes), G groups of EG = E / G experts, k experts per token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_launch_dependents, pdl_wait

__all__ = ["route_triton"]


@triton.jit
def _route_kernel(
    logits_ptr,  # [T, E] fp32
    bias_ptr,  # [E] fp32
    weights_ptr,  # [T, k] fp32
    ids_ptr,  # [T, k] int64
    E,
    stride_l,
    stride_w,
    stride_i,
    scaling,
    TOP_K: tl.constexpr,
    BLOCK_K: tl.constexpr,  # >= TOP_K
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORM: tl.constexpr,
    BLOCK_E: tl.constexpr,  # >= E; = E when N_GROUP > 1
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): the bias loads before the wait
):
    pdl_launch_dependents(PDL)
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, BLOCK_E)
    valid = e < E
    bias = tl.load(bias_ptr + e, mask=valid, other=0.0)  # a weight: constant (rule 2)
    pdl_wait(PDL)
    logit = tl.load(logits_ptr + t * stride_l + e, mask=valid, other=0.0)
    scores = 1.0 / (1.0 + tl.exp(-logit))  # [BLOCK_E]
    biased = tl.where(valid, scores + bias, float("-inf"))
    if N_GROUP > 1:
        EG: tl.constexpr = BLOCK_E // N_GROUP
        grouped = tl.reshape(biased, (N_GROUP, EG))
        gid = tl.reshape(e, (N_GROUP, EG))
        top1 = tl.max(grouped, axis=1)  # [G]
        first = tl.min(tl.where(grouped == top1[:, None], gid, BLOCK_E), axis=1)
        top2 = tl.max(tl.where(gid == first[:, None], float("-inf"), grouped), axis=1)
        group_scores = top1 + top2
        g = tl.arange(0, N_GROUP)
        keep = g < 0  # [G] all False
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.max(tl.where(keep, float("-inf"), group_scores), axis=0)
            pick = tl.min(tl.where((group_scores == best) & ~keep, g, N_GROUP), axis=0)
            keep = keep | (g == pick)
        kept = tl.reshape(tl.broadcast_to(keep[:, None], (N_GROUP, EG)), (BLOCK_E,))
        biased = tl.where(kept, biased, float("-inf"))
    slot = tl.arange(0, BLOCK_K)
    chosen_w = tl.zeros((BLOCK_K,), dtype=tl.float32)
    chosen_id = tl.zeros((BLOCK_K,), dtype=tl.int64)
    for j in tl.static_range(TOP_K):
        best = tl.max(biased, axis=0)
        pick = tl.min(tl.where(biased == best, e, BLOCK_E), axis=0)
        w = tl.sum(tl.where(e == pick, scores, 0.0), axis=0)
        chosen_w = tl.where(slot == j, w, chosen_w)
        chosen_id = tl.where(slot == j, pick.to(tl.int64), chosen_id)
        biased = tl.where(e == pick, float("-inf"), biased)
    if NORM:
        chosen_w = chosen_w / (tl.sum(chosen_w, axis=0) + 1e-20)
    km = slot < TOP_K
    tl.store(weights_ptr + t * stride_w + slot, chosen_w * scaling, mask=km)
    tl.store(ids_ptr + t * stride_i + slot, chosen_id, mask=km)


def route_triton(
    logits: torch.Tensor,  # [T, E] float32
    bias: torch.Tensor,  # [E] float32
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`route_ref` in one launch → (weights [T, k] float32, ids [T, k] int64)."""
    if logits.dim() != 2 or logits.dtype != torch.float32 or logits.stride(1) != 1:
        raise ValueError(
            f"logits must be float32 [T, E] with unit stride in E, got {logits.dtype} {tuple(logits.shape)}"
        )
    T, E = logits.shape
    if bias.shape != (E,) or bias.dtype != torch.float32 or bias.stride(0) != 1:
        raise ValueError(f"bias must be contiguous float32 [{E}]")
    if not 0 < top_k <= E:
        raise ValueError(f"top_k must be in [1, {E}], got {top_k}")
    size = E // n_group if n_group > 1 else 1
    if n_group > 1 and (E % n_group or size & (size - 1) or n_group & (n_group - 1)):  # `is_kernel_shape`
        raise ValueError(
            f"grouped routing needs power-of-two groups of a power-of-two size, got E={E}, G={n_group}"
        )
    if n_group > 1 and not 0 < topk_group <= n_group:
        raise ValueError(f"topk_group must be in [1, {n_group}], got {topk_group}")
    weights = torch.empty((T, top_k), dtype=torch.float32, device=logits.device)
    ids = torch.empty((T, top_k), dtype=torch.int64, device=logits.device)
    if T == 0:
        return weights, ids
    block_e = triton.next_power_of_2(E)
    _route_kernel[(T,)](
        logits, bias, weights, ids, E, logits.stride(0), weights.stride(0), ids.stride(0), scaling,
        TOP_K=top_k, BLOCK_K=triton.next_power_of_2(top_k), N_GROUP=max(n_group, 1), TOPK_GROUP=topk_group,
        NORM=norm_topk_prob, BLOCK_E=block_e, **pdl_args(logits.device), num_warps=4 if block_e <= 512 else 8,
    )  # fmt: skip
    return weights, ids

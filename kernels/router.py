"""DeepSeek-style `noaux_tc` MoE routing after the gate's GEMV: the op's public entry `route(args)`
(the Triton kernel of `kernels/router_triton.py` on CUDA, one launch for what torch runs as ~9:
sigmoid, bias, group top-2 and top-k, the expert top-k and its sort, gather, sum, divide, scale), the
torch reference `route_ref` elsewhere.

Sigmoid scores in float32; `bias` (e_score_correction_bias) is added only to choose experts,
group-limited when `n_group > 1` (a group scores the sum of its top-2 biased scores, `topk_group`
groups survive); the chosen experts, best biased score first, are weighed by the UNBIASED scores,
renormalised when `norm_topk_prob`, times `scaling`.

Shapes: T tokens, E experts, k experts per token, G groups.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RouteArgs:
    logits: torch.Tensor  # [T, E] float32, the gate's x·Wᵀ
    bias: torch.Tensor  # [E] float32 selection bias
    top_k: int  # k
    n_group: int  # G (1: no group limit)
    topk_group: int
    norm_topk_prob: bool
    scaling: float  # routed_scaling_factor


def route(args: RouteArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The op → (weights [T, k] float32, expert ids [T, k] int64). Triton on CUDA (triton is the gpu
    extra: imported only there), the reference elsewhere."""
    a = args
    run = route_ref
    if a.logits.is_cuda and is_kernel_shape(a.logits.shape[1], a.n_group):
        from kernels.router_triton import route_triton as run
    return run(a.logits, a.bias, a.top_k, a.n_group, a.topk_group, a.norm_topk_prob, a.scaling)


def is_kernel_shape(num_experts: int, n_group: int) -> bool:
    """The kernel splits the experts' lanes into groups: power-of-two groups of a power-of-two size
    (DeepSeek-V3's 8 × 32; one group, as GLM-5 and Kimi K2 route, always fits)."""
    size = num_experts // n_group if n_group > 1 else 1
    return n_group <= 1 or (
        num_experts % n_group == 0 and size & (size - 1) == 0 and n_group & (n_group - 1) == 0
    )


def route_ref(
    logits: torch.Tensor,
    bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    T, E = logits.shape
    scores = logits.sigmoid()  # [T, E]
    biased = scores + bias
    if n_group > 1:
        grouped = biased.view(T, n_group, E // n_group)
        group_scores = grouped.topk(2, dim=-1).values.sum(-1)  # [T, G]
        keep = torch.zeros_like(group_scores, dtype=torch.bool)
        keep.scatter_(1, group_scores.topk(topk_group, dim=-1).indices, True)
        biased = biased.masked_fill(~keep.repeat_interleave(E // n_group, dim=1), float("-inf"))
    ids = biased.topk(top_k, dim=-1).indices  # [T, k]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * scaling, ids

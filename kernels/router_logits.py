"""The MoE gate's product, `logits = x.float() @ weightᵀ` (float32 logits of a bf16 hidden state against
the router's float32 weight): the op's public entry `router_logits(args)` (at decode sizes one Triton
launch on CUDA, `kernels/router_logits_triton.py`, where torch runs two: the bf16 → float32 cast of x,
then cuBLAS's float32 GEMV), the torch reference `router_logits_ref` elsewhere and for prefill.

The kernel widens x as it loads it (exact) and sums in float32 in its own fixed order, so a logit is the
reference's up to float32 rounding of the sum (cuBLAS's order is not the reference's either).

Shapes: T tokens, H hidden, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

# tokens up to which CUDA runs the GEMV kernel (decode, and a speculative step's few rows); past it the
# cast is one launch among a GEMM's worth of work
GEMV_MAX_TOKENS = 8


@dataclass(frozen=True, slots=True)
class RouterLogitsArgs:
    x: torch.Tensor  # [T, H] bf16 / fp16 / fp32, unit stride in H
    weight: torch.Tensor  # [E, H] float32, unit stride in H


def router_logits(args: RouterLogitsArgs) -> torch.Tensor:
    """The op → [T, E] float32. Triton on CUDA up to `GEMV_MAX_TOKENS` rows, the reference elsewhere."""
    if args.x.is_cuda and args.x.shape[0] <= GEMV_MAX_TOKENS:
        from kernels.router_logits_triton import router_logits_triton

        return router_logits_triton(args.x, args.weight)
    return router_logits_ref(args.x, args.weight)


def router_logits_ref(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.linear(x.float(), weight)

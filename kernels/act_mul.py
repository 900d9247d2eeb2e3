"""`act(gate) · up` of a gated MLP (SwiGLU: `F.silu(gate) * up`): the op's public entry `act_mul(args)`
(one Triton launch on CUDA, `kernels/act_mul_triton.py`, where torch runs two: the activation, then
the product), the torch reference `act_mul_ref` elsewhere and for activations without a kernel.

The kernel keeps torch's roundings: the activation computed in float32 and rounded to gate's dtype,
then the product computed in float32 and rounded (what `F.silu(gate) * up` does in bf16); its
`exp` is Triton's, not CUDA's `expf`, so a value may differ from torch's in its last bit.

Shapes: T rows, I the intermediate width (gate and up may be views of one [T, 2I] product).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class ActMulArgs:
    gate: torch.Tensor  # [T, I], unit stride in I
    up: torch.Tensor  # [T, I] gate's dtype, unit stride in I
    act: Callable[
        [torch.Tensor], torch.Tensor
    ]  # the checkpoint's hidden_act (backend/models/layers/linear.py)


def act_mul(args: ActMulArgs) -> torch.Tensor:
    """The op → [T, I] contiguous. Triton on CUDA for SiLU, the reference elsewhere."""
    if args.gate.is_cuda and args.act is F.silu:
        from kernels.act_mul_triton import silu_mul_triton

        return silu_mul_triton(args.gate, args.up)
    return act_mul_ref(args.gate, args.up, args.act)


def act_mul_ref(
    gate: torch.Tensor, up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    return act(gate) * up

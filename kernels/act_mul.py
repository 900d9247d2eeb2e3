"""`act(gate) · up` of a gated MLP (SwiGLU: `F.silu(gate) * up`): the op's public entry `act_mul(args)`
(one Triton launch on CUDA, `kernels/act_mul_triton.py`, where torch runs two: the activation, then
the product), the torch reference `act_mul_ref` elsewhere and for activations without a kernel.

The kernel keeps torch's roundings: the activation computed in float32 and rounded to gate's dtype,
then the product computed in float32 and rounded (what `F.silu(gate) * up` does in bf16); its
`exp` is Triton's, not CUDA's `expf`, so a value may differ from torch's in its last bit.

With `route` (the every-expert MoE path, backend/models/layers/moe.py): the rows are expert-major,
row r = e·N + t for local expert e and token t, and each is multiplied by that expert's routing
weight for the token (0 where the token did not choose it), `(act(gate) · up) · w` rounded to gate's
dtype: the product rounded first, then weighted in float32, as `(act(gate) * up) * w_f32` then
`.to(gate.dtype)` computes it. The kernel reads the weight off the token's top-k ids, where torch
builds the dense [N, El] routing matrix first (a fill and a scatter) and weighs and casts after (two
launches more).

Shapes: T rows (El·N with a route), I the intermediate width (gate and up may be views of one
[T, 2I] product), N tokens, k experts a token.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.op_args import ExpertRoute


@dataclass(frozen=True, slots=True)
class ActMulArgs:
    gate: torch.Tensor  # [T, I], unit stride in I
    up: torch.Tensor  # [T, I] gate's dtype, unit stride in I
    act: Callable[
        [torch.Tensor], torch.Tensor
    ]  # the checkpoint's hidden_act (backend/models/layers/linear.py)
    route: ExpertRoute | None = None  # rows weighted by their expert's routing weight (module)


def act_mul(args: ActMulArgs) -> torch.Tensor:
    """The op → [T, I] contiguous. Triton on CUDA for SiLU, the reference elsewhere."""
    if args.gate.is_cuda and args.act is F.silu:
        from kernels.act_mul_triton import silu_mul_triton

        return silu_mul_triton(args.gate, args.up, args.route)
    out = act_mul_ref(args.gate, args.up, args.act)
    return out if args.route is None else weigh_by_route(out, args.route)


def act_mul_ref(
    gate: torch.Tensor, up: torch.Tensor, act: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    return act(gate) * up


def weigh_by_route(act: torch.Tensor, route: ExpertRoute) -> torch.Tensor:
    """`act [El·N, I]` (expert-major rows) times each row's routing weight, in float32, rounded to
    act's dtype."""
    N = route.ids.shape[0]
    El = act.shape[0] // N if N else 0
    local = route.ids - route.first_expert  # [N, k]
    columns = torch.where((local >= 0) & (local < El), local, El)  # other experts: the spare column
    dense = torch.zeros(N, El + 1, dtype=torch.float32, device=act.device)
    dense.scatter_add_(1, columns, route.weights.float())  # [N, El + 1]
    # a bf16 × float32 product is computed on float(act), the same values as `act.float() * w`
    return (act.view(El, N, act.shape[1]) * dense[:, :El].T[:, :, None]).view_as(act).to(act.dtype)

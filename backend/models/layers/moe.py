"""Dense MLP and the DeepSeek-style MoE block (sigmoid `noaux_tc` routing, shared experts).

Routing (engine-anchors §1c): sigmoid scores in float32; `e_score_correction_bias` is added only to
choose experts (group-limited when `n_group > 1`: a group scores the sum of its top-2 biased
scores, `topk_group` groups survive); the chosen experts are weighed by the UNBIASED scores,
renormalised when `norm_topk_prob`, times `routed_scaling_factor` (after the gate's GEMV, one
launch on CUDA: `kernels/router.py`). The shared experts are added
unscaled. Experts are split over ranks by contiguous id range (expert parallelism), and with fewer
expert groups than ranks each expert by its intermediate dims (backend/models/layers/parallel.py); the
routed and shared partial sums are combined by one all-reduce.

Shape letters: T tokens, H hidden, E experts (El local), I expert intermediate, k experts per token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from backend.engine.sync_free import is_sync_free
from backend.errors import CheckpointError
from backend.models.layers.fused import FusedLinear, fuse_group
from backend.models.layers.linear import Shard, _copy, activation, column, row
from backend.models.layers.parallel import Parallel
from backend.models.model_config import ModelConfig
from kernels.act_mul import ActMulArgs, act_mul
from kernels.op_args import ExpertRoute
from kernels.router import RouteArgs, route
from kernels.router_logits import RouterLogitsArgs, router_logits


class DenseMLP(nn.Module):
    """`down(act(gate(x)) · up(x))`; gate and up are one `gate_up_proj` product once the loaded model
    is fused (backend/models/layers/fused.py): this rank's gate rows, then its up rows."""

    def __init__(self, hidden: int, intermediate: int, act: str, shard: Shard, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = column(hidden, intermediate, shard, dtype=dtype)
        self.up_proj = column(hidden, intermediate, shard, dtype=dtype)
        self.down_proj = row(intermediate, hidden, shard, dtype=dtype)
        self.act = activation(act)
        self.gate_up_proj: FusedLinear | None = None

    def fuse_projections(self) -> bool:
        return fuse_group(self, ["gate_proj", "up_proj"], "gate_up_proj")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x)  # [T, I] each, views of one product
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(act_mul(ActMulArgs(gate, up, self.act)))  # one launch on CUDA


class Router(nn.Module):
    """The `mlp.gate` module: a float32 `[E, H]` weight and the float32 selection bias."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        E = config.num_routed_experts
        self.weight = nn.Parameter(
            torch.empty(E, config.hidden_size, dtype=torch.float32), requires_grad=False
        )
        self.register_buffer("e_score_correction_bias", torch.zeros(E, dtype=torch.float32))
        self.top_k = config.num_experts_per_tok
        self.n_group, self.topk_group = config.n_group, config.topk_group
        self.norm_topk_prob = config.norm_topk_prob
        self.routed_scaling_factor = config.routed_scaling_factor

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] → (weights [T, k] float32, expert ids [T, k] int64): the gate's GEMV (decode on
        CUDA: one launch that widens x as it reads it, `kernels/router_logits.py`), then the selection
        in one launch on CUDA (`kernels/router.py`)."""
        logits = router_logits(RouterLogitsArgs(x, self.weight))  # [T, E] float32
        return route(
            RouteArgs(
                logits,
                self.e_score_correction_bias,
                self.top_k,
                self.n_group,
                self.topk_group,
                self.norm_topk_prob,
                self.routed_scaling_factor,
            )
        )


# the most multiply-adds (tokens × local experts × 3 · I · H) the every-expert path may spend where the
# loop would run on CUDA: up to it, an eager forward (a prefill, a speculative step's host-path or
# catch-up forward) runs without the loop's host syncs and per-expert launches (nano models: ~5,400
# tokens; 2026-12-05's H100 profiles had 8 syncs and ~80 launches per MoE layer of a nano prefill)
EVERY_EXPERT_MACS = 1 << 32


class Experts(nn.Module):
    """Local experts `[e0, e1)` as fused tensors: gate_up_proj [El, 2I, H], down_proj [El, H, I],
    where I is this rank's intermediate range `[i0, i1)` of each expert (all of it unless `width`
    splits the experts over several ranks)."""

    def __init__(
        self, config: ModelConfig, shard: Shard, *, dtype: torch.dtype, width: Shard | None = None
    ) -> None:
        super().__init__()
        self.e0, self.e1 = shard.split(config.num_routed_experts, "routed experts")
        self.num_global_experts = config.num_routed_experts
        self.full_intermediate = config.moe_intermediate_size
        self.i0, self.i1 = (width or Shard()).split(self.full_intermediate, "expert intermediate size")
        El, H, I = self.e1 - self.e0, config.hidden_size, self.i1 - self.i0
        self.gate_up_proj = nn.Parameter(torch.empty(El, 2 * I, H, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(El, H, I, dtype=dtype), requires_grad=False)
        self.intermediate = I
        self.act = activation(config.hidden_act)

    @property
    def is_width_split(self) -> bool:
        return self.intermediate != self.full_intermediate

    def parts_per_param(self) -> dict[str, int]:
        """How many per-expert checkpoint tensors fill each fused parameter (for missing-tensor checks)."""
        El = self.e1 - self.e0
        return {"gate_up_proj": 2 * El, "down_proj": El}

    def load_param(self, name: str, full: torch.Tensor) -> int:
        """The fused 3-D form: `experts.gate_up_proj [E, 2I, H]`, `experts.down_proj [E, H, I]`."""
        if name not in ("gate_up_proj", "down_proj"):
            raise CheckpointError(f"unexpected expert tensor {name!r}")
        mine = full[self.e0 : self.e1]
        i0, i1, I = self.i0, self.i1, self.full_intermediate
        if name == "gate_up_proj":  # [El, 2I, H]: this rank's rows of gate, then of up
            mine = (
                torch.cat([mine[:, i0:i1], mine[:, I + i0 : I + i1]], dim=1) if self.is_width_split else mine
            )
        else:  # [El, H, I]
            mine = mine[:, :, i0:i1]
        _copy(getattr(self, name), mine, f"experts.{name}")
        return self.parts_per_param()[name]

    def load_expert(self, expert: int, proj: str, w: torch.Tensor) -> int:
        """One per-expert tensor `experts.{expert}.{gate,up,down}_proj.weight`; 0 if not on this rank."""
        if not self.e0 <= expert < self.e1:
            return 0
        e, I, i0, i1 = expert - self.e0, self.intermediate, self.i0, self.i1
        if proj == "gate_proj":
            _copy(self.gate_up_proj[e, :I], w[i0:i1], f"experts.{expert}.gate_proj")
        elif proj == "up_proj":
            _copy(self.gate_up_proj[e, I:], w[i0:i1], f"experts.{expert}.up_proj")
        elif proj == "down_proj":
            _copy(self.down_proj[e], w[:, i0:i1], f"experts.{expert}.down_proj")
        else:
            raise CheckpointError(f"unexpected expert projection {proj!r}")
        return 1

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] → this rank's share of the routed sum [T, H], `+ add` [T, H]
        when given (the shared experts' output, as the quantized experts' fused kernel adds it): the
        loop over the experts in use, or on CUDA while the work is small (`EVERY_EXPERT_MACS`) and in
        a captured step, the every-expert path (no host sync: the loop's `unique().tolist()` and
        `where` each wait for the device)."""
        T, El = x.shape[0], self.e1 - self.e0
        macs = T * El * 3 * self.intermediate * x.shape[1]
        if is_sync_free() or (x.is_cuda and macs <= EVERY_EXPERT_MACS):
            routed = self.forward_every_expert(x, weights, ids)
            return routed if add is None else routed + add
        out = torch.zeros_like(x)
        local = ids - self.e0  # [T, k]
        for e in torch.unique(local[(local >= 0) & (local < self.e1 - self.e0)]).tolist():
            tok, slot = torch.where(local == e)
            gate, up = F.linear(x[tok], self.gate_up_proj[e]).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(self.act(gate) * up, self.down_proj[e])  # [n, H]
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out if add is None else out + add

    def forward_every_expert(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`forward` with fixed shapes (no host sync, so a CUDA graph can hold it): every local expert
        runs on every token and the routing weights, zero for unchosen experts, pick the sum. El/k
        times the work of the loop; for decode-sized T, or small work (unquantized experts only:
        INT4 and FP8 ones go through the fused MoE kernels)."""
        T = x.shape[0]
        gate, up = torch.matmul(x, self.gate_up_proj.transpose(1, 2)).chunk(2, dim=-1)  # [El, T, I] each
        El, I = gate.shape[0], gate.shape[-1]
        # act(gate) · up, weighted by each expert's routing weight for the token (0 where it was not
        # chosen) and rounded to x's dtype: one launch on CUDA over the [El·T, I] rows of the views,
        # which reads the weights off the top-k ids (torch: a fill, a scatter, the product, a cast)
        route = ExpertRoute(ids, weights.float(), self.e0)
        act = act_mul(ActMulArgs(gate.reshape(-1, I), up.reshape(-1, I), self.act, route)).view(El, T, I)
        y = torch.bmm(act, self.down_proj.transpose(1, 2))  # [El, T, H]
        return y.sum(0)  # [T, H]: one rounding (the sum accumulates in float32)


class MoE(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate = Router(config)
        self.experts = Experts(config, parallel.expert_shard, dtype=dtype, width=parallel.expert_width_shard)
        self.shard = parallel.shard
        self.shared_experts = (
            DenseMLP(
                config.hidden_size,
                config.moe_intermediate_size * config.num_shared_experts,
                config.hidden_act,
                self.shard.deferred(),  # its partial sum rides on the routed experts' all-reduce
                dtype=dtype,
            )
            if config.num_shared_experts
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # dispatch: x [T, H] and the routing are the same on every rank; combine: one all-reduce
        weights, ids = self.gate(x)
        # the shared experts first: the routed experts add their output (INT4 / FP8 on CUDA: in the
        # fused MoE's down epilogue at decode, no add launch; the same bytes as `routed + shared`)
        shared = self.shared_experts(x) if self.shared_experts is not None else None
        return self.shard.all_reduce(self.experts(x, weights, ids, add=shared))

"""Routed experts with quantized weights: the drop-in for `backend.models.layers.moe.Experts`.

Same contract as the dense module (local experts `[e0, e1)`, `forward(x, weights, ids)`,
`parts_per_param()` for the loader's completeness check), filled from the per-expert tensors a
quantized checkpoint stores: `experts.{e}.{gate,up,down}_proj.{weight_packed, weight_scale,
weight_shape}` (INT4), `.{weight, weight_scale}` (FP8 per channel) or `.{weight, weight_scale_inv}`
(FP8 blocks; `.weight_scale` in compressed-tensors' block format, per `scheme.block_scale_name`).
Fused per local expert, as the dense module fuses them:

    int4        gate_up_packed [El, 2I, H/8]   gate_up_scale [El, 2I, H/g]    down_packed [El, H, I/8]   down_scale [El, H, I/g]
    fp8-channel gate_up_proj   [El, 2I, H]     gate_up_scale [El, 2I, 1]      down_proj   [El, H, I]     down_scale [El, H, 1]
    fp8-block   gate_up_proj   [El, 2I, H]     gate_scale_inv, up_scale_inv [El, I/128, H/128]   down_scale_inv [El, H/128, I/128]

(block scales of gate and up stay apart: with I not a multiple of 128 their edge blocks differ.)
Shape letters: El local experts, H hidden, I expert intermediate, T tokens, k experts per token.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from backend.engine.sync_free import is_sync_free
from backend.errors import CheckpointError
from backend.quant.linear import _copy
from backend.quant.scheme import QuantScheme
from kernels.formats.fp8 import FP8, dequantize_fp8_block, dequantize_fp8_channel
from kernels.formats.int4 import dequantize_int4

_PROJS = ("gate_proj", "up_proj", "down_proj")


class QuantExperts(nn.Module):
    gate_up_packed: torch.Tensor  # int4 buffers (registered in __init__), typed for the fused kernel's call
    gate_up_scale: torch.Tensor
    down_packed: torch.Tensor
    down_scale: torch.Tensor
    gate_up_proj: torch.Tensor  # fp8 buffers
    down_proj: torch.Tensor
    gate_scale_inv: torch.Tensor
    up_scale_inv: torch.Tensor
    down_scale_inv: torch.Tensor

    def __init__(
        self,
        scheme: QuantScheme,
        *,
        e0: int,
        e1: int,
        hidden: int,
        intermediate: int,
        act: Callable[[torch.Tensor], torch.Tensor],
        num_global_experts: int | None = None,  # every rank's (None: all of them here)
    ) -> None:
        super().__init__()
        self.scheme, self.e0, self.e1 = scheme, e0, e1
        # the share of a token's experts expected here under expert parallelism: the fused kernels
        # size their work for the pairs that are (`kernels/moe_routing.py` `run_moe`)
        self.local_share = (e1 - e0) / num_global_experts if num_global_experts else 1.0
        self.hidden, self.intermediate, self.act = hidden, intermediate, act
        El, H, I = e1 - e0, hidden, intermediate
        shapes = {"gate_proj": (I, H), "up_proj": (I, H), "down_proj": (H, I)}
        self._params: dict[tuple[str, str], tuple[str, slice]] = {}  # (proj, tensor) -> (buffer, rows)
        gu = {"gate_proj": slice(0, I), "up_proj": slice(I, 2 * I), "down_proj": slice(None)}
        if scheme.method == "int4":
            g = scheme.group_size
            self._buffer("gate_up_packed", (El, 2 * I, math.ceil(H / 8)), torch.int32)
            self._buffer("gate_up_scale", (El, 2 * I, math.ceil(H / g)), torch.bfloat16)
            self._buffer("down_packed", (El, H, math.ceil(I / 8)), torch.int32)
            self._buffer("down_scale", (El, H, math.ceil(I / g)), torch.bfloat16)
            for p in _PROJS:
                fused = "down" if p == "down_proj" else "gate_up"
                self._params[(p, "weight_packed")] = (f"{fused}_packed", gu[p])
                self._params[(p, "weight_scale")] = (f"{fused}_scale", gu[p])
        else:
            # named as the dense module's parameters: the loader counts `.weight` tensors under them
            self._buffer("gate_up_proj", (El, 2 * I, H), FP8)
            self._buffer("down_proj", (El, H, I), FP8)
            for p in _PROJS:
                self._params[(p, "weight")] = ("down_proj" if p == "down_proj" else "gate_up_proj", gu[p])
            if scheme.method == "fp8-channel":
                self._buffer("gate_up_scale", (El, 2 * I, 1), torch.float32)
                self._buffer("down_scale", (El, H, 1), torch.float32)
                for p in _PROJS:
                    self._params[(p, "weight_scale")] = (
                        "down_scale" if p == "down_proj" else "gate_up_scale",
                        gu[p],
                    )
            else:
                bn, bk = scheme.block
                for p in _PROJS:
                    n, k = shapes[p]
                    name = f"{p.removesuffix('_proj')}_scale_inv"
                    self._buffer(name, (El, math.ceil(n / bn), math.ceil(k / bk)), torch.float32)
                    self._params[(p, scheme.block_scale_name)] = (name, slice(None))

    def _buffer(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self.register_buffer(name, torch.zeros(shape, dtype=dtype))

    def parts_per_param(self) -> dict[str, int]:
        """How many per-expert checkpoint tensors fill each buffer (for the missing-tensor check)."""
        counts: dict[str, int] = {}
        for buffer, _ in self._params.values():
            counts[buffer] = counts.get(buffer, 0) + (self.e1 - self.e0)
        return counts

    def load_expert_part(self, expert: int, proj: str, tensor_name: str, w: torch.Tensor) -> tuple[str, int]:
        """One tensor `experts.{expert}.{proj}.{tensor_name}`; returns (buffer it filled, count)."""
        if tensor_name == "weight_shape":
            n, k = (
                (self.hidden, self.intermediate) if proj == "down_proj" else (self.intermediate, self.hidden)
            )
            if [int(v) for v in w.tolist()] != [n, k]:
                raise CheckpointError(f"experts.{expert}.{proj}.weight_shape {w.tolist()} != [{n}, {k}]")
            return "", 0
        if (proj, tensor_name) not in self._params:
            raise CheckpointError(
                f"unexpected tensor experts.{expert}.{proj}.{tensor_name} for {self.scheme.method} experts"
            )
        buffer, rows = self._params[(proj, tensor_name)]
        if not self.e0 <= expert < self.e1:
            return buffer, 0
        if tensor_name == "weight" and w.dtype != FP8:
            raise CheckpointError(f"experts.{expert}.{proj}.weight is {w.dtype}, expected {FP8}")
        _copy(
            getattr(self, buffer)[expert - self.e0, rows],
            w.reshape(getattr(self, buffer)[0, rows].shape),
            f"experts.{expert}.{proj}.{tensor_name}",
        )
        return buffer, 1

    def load_expert(self, expert: int, proj: str, w: torch.Tensor) -> int:
        """A per-expert `.weight`: FP8 experts store theirs there; a float one means the checkpoint's
        config and tensors disagree."""
        if self.scheme.method != "int4" and w.dtype == FP8:
            return self.load_expert_part(expert, proj, "weight", w)[1]
        raise CheckpointError(
            f"experts.{expert}.{proj}.weight is unquantized ({w.dtype}) but the checkpoint's quantization_config "
            f"quantizes routed experts ({self.scheme.method})"
        )

    def expert_weights(self, e: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Local expert e dequantized: (gate_up [2I, H], down [H, I])."""
        H, I = self.hidden, self.intermediate
        m = self.scheme.method
        if m == "int4":
            g = self.scheme.group_size
            gate_up = dequantize_int4(self.gate_up_packed[e], self.gate_up_scale[e], H, g, dtype)
            down = dequantize_int4(self.down_packed[e], self.down_scale[e], I, g, dtype)
        elif m == "fp8-channel":
            gate_up = dequantize_fp8_channel(self.gate_up_proj[e], self.gate_up_scale[e], dtype)
            down = dequantize_fp8_channel(self.down_proj[e], self.down_scale[e], dtype)
        else:
            b = self.scheme.block
            gate = dequantize_fp8_block(self.gate_up_proj[e, :I], self.gate_scale_inv[e], b, dtype)
            up = dequantize_fp8_block(self.gate_up_proj[e, I:], self.up_scale_inv[e], b, dtype)
            gate_up = torch.cat([gate, up])
            down = dequantize_fp8_block(self.down_proj[e], self.down_scale_inv[e], b, dtype)
        return gate_up, down

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, H], weights/ids [T, k] -> this rank's share of the routed sum [T, H], `+ add` [T, H]
        when given (the shared experts' output: in the fused MoE's last epilogue on CUDA's decode path)."""
        if x.is_cuda and self._can_fuse():  # one fused MoE, no host sync (CUDA-graph safe)
            local_ids = ids - self.e0 if self.e0 else ids  # other ranks' experts fall outside [0, El)
            return self._fused(x, weights, local_ids, add)
        if x.is_cuda and is_sync_free():  # a decode-graph capture: the loop below syncs; the log says why
            raise RuntimeError(f"routed {self.scheme.method} experts with {self.act} have no fused kernel")
        out = torch.zeros_like(x)
        local = ids - self.e0  # [T, k]
        for e in torch.unique(local[(local >= 0) & (local < self.e1 - self.e0)]).tolist():
            tok, slot = torch.where(local == e)
            w_gate_up, w_down = self.expert_weights(e, x.dtype)
            gate, up = F.linear(x[tok], w_gate_up).chunk(2, dim=-1)  # [n, I] each
            y = F.linear(self.act(gate) * up, w_down)  # [n, H]
            out.index_add_(0, tok, (y * weights[tok, slot, None]).to(out.dtype))
        return out if add is None else out + add

    def _fused(
        self, x: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor, add: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The fused kernel of this scheme (triton is the gpu extra: imported only here)."""
        m, I = self.scheme.method, self.intermediate
        if m == "int4":
            from kernels.fused_moe import fused_moe

            return fused_moe(
                x, local_ids, weights, self.gate_up_packed, self.gate_up_scale, self.down_packed, self.down_scale,
                self.scheme.group_size, add=add, local_share=self.local_share,
            )  # fmt: skip
        from kernels.fused_moe_fp8 import fused_moe_fp8

        w13, w2 = self.gate_up_proj, self.down_proj
        if m == "fp8-channel":  # [El, 2I, 1] halves: views with equal strides
            s13 = self.gate_up_scale
            return fused_moe_fp8(
                x, local_ids, weights, w13, w2, s13[:, :I], s13[:, I:], self.down_scale, add=add,
                local_share=self.local_share,
            )  # fmt: skip
        return fused_moe_fp8(
            x, local_ids, weights, w13, w2, self.gate_scale_inv, self.up_scale_inv, self.down_scale_inv,
            block=self.scheme.block, add=add, local_share=self.local_share,
        )  # fmt: skip

    def _can_fuse(self) -> bool:
        """SiLU experts in a layout a fused kernel reads: INT4 in whole groups (`kernels.fused_moe`), FP8
        per channel or in blocks whose K side is a power of two >= 16 (`kernels.fused_moe_fp8`)."""
        if self.act is not F.silu:
            return False
        m = self.scheme.method
        if m == "int4":
            g = self.scheme.group_size
            return self.hidden % g == 0 and self.intermediate % g == 0
        if m == "fp8-channel":
            return True
        bk = self.scheme.block[1]
        return bk >= 16 and bk & (bk - 1) == 0

    def extra_repr(self) -> str:
        return f"experts=[{self.e0}, {self.e1}), method={self.scheme.method}"

"""Linear layers that hold only this rank's slice of a checkpoint tensor.

A later tensor-parallel split only has to pass a different `Shard`: column-parallel layers keep a
range of output rows, row-parallel layers a range of input columns and all-reduce their output.
On one rank every range is the whole tensor and no collective runs.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from torch import nn

from backend.errors import CheckpointError

Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Shard:
    rank: int = 0
    world_size: int = 1
    reduces: bool = True  # False: a row-parallel layer leaves its partial sum to the caller's all-reduce

    def split(self, n: int, what: str) -> Range:
        """This rank's contiguous range of `n` items split evenly over the ranks."""
        if n % self.world_size:
            raise CheckpointError(f"{what} ({n}) does not divide over {self.world_size} ranks")
        size = n // self.world_size
        return self.rank * size, (self.rank + 1) * size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1 and self.reduces:
            torch.distributed.all_reduce(x)
        return x

    def deferred(self) -> Shard:
        """This split, with row-parallel outputs left as partial sums (one all-reduce can then sum
        several layers' partials: the MoE combine carries the shared experts')."""
        return replace(self, reduces=False)


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    if name == "silu":
        return F.silu
    if name in ("gelu", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh" if name.endswith("tanh") else "none")
    raise CheckpointError(f"unsupported hidden_act {name!r}")


class Linear(nn.Module):
    """`y = x Wᵀ + b` over `W[out_range, in_range]` of the checkpoint's full `[out, in]` weight."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        dtype: torch.dtype,
        bias: bool = False,
        out_range: Range | None = None,
        in_range: Range | None = None,
        shard: Shard | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features  # the full checkpoint shape
        self.out_range = out_range or (0, out_features)
        self.in_range = in_range or (0, in_features)
        self.shard = shard or Shard()
        self.is_row_parallel = self.in_range != (0, in_features)
        out_local = self.out_range[1] - self.out_range[0]
        in_local = self.in_range[1] - self.in_range[0]
        self.weight = nn.Parameter(torch.empty(out_local, in_local, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(out_local, dtype=dtype), requires_grad=False) if bias else None

    def load_param(self, name: str, full: torch.Tensor) -> None:
        o0, o1 = self.out_range
        if name == "weight":
            i0, i1 = self.in_range
            _copy(self.weight, full[o0:o1, i0:i1], name)
        elif name == "bias" and self.bias is not None:
            # a row-parallel bias is added once, on the rank holding the first input columns
            _copy(self.bias, full[o0:o1] if self.in_range[0] == 0 else torch.zeros_like(full[o0:o1]), name)
        else:
            raise CheckpointError(f"unexpected tensor {name!r} for a linear layer")

    if TYPE_CHECKING:  # nn.Module types every call `(...) -> Any`; at run time its hooks apply

        def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor: ...

    # ---- stacking (backend/models/layers/fused.py): Linears reading the same input as one product
    def stack_key(self) -> Hashable | None:
        """Layers with equal keys stack into one (`stacked`); None: never (a row-parallel layer's
        output is a partial sum)."""
        if self.is_row_parallel:
            return None
        return (Linear, self.weight.shape[1], self.weight.dtype, self.weight.device)

    @property
    def row_block(self) -> int:
        """A part's rows must be a multiple of this for another part to follow it in a stack."""
        return 1

    @classmethod
    def stacked(cls, parts: Sequence[Linear]) -> Linear:
        """One layer whose output is the parts' outputs side by side: their (local) rows stacked."""
        weight = torch.cat([p.weight for p in parts])  # [sum of the parts' rows, K]
        with torch.device("meta"):  # storage comes from the parts
            out = cls(weight.shape[1], weight.shape[0], dtype=weight.dtype, bias=has_bias(parts))
        out.weight = nn.Parameter(weight, requires_grad=False)
        if out.bias is not None:
            out.bias = nn.Parameter(
                stacked_bias(parts, [p.weight.shape[0] for p in parts]), requires_grad=False
            )
        return out

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x [..., K] → y [..., N] in the weight's dtype; a narrower x (bf16 into the DSA indexer's
        float32 `weights_proj`) is widened first, exactly. `rows`: only y's first columns
        [..., rows], from a row-prefix view of the weight (a stack's leading parts: `FusedLinear`)."""
        w: torch.Tensor = self.weight
        b: torch.Tensor | None = self.bias
        if rows is not None:
            w, b = w[:rows], None if b is None else b[:rows]
        if x.dtype != w.dtype and torch.promote_types(x.dtype, w.dtype) == w.dtype:
            x = x.to(w.dtype)
        y = F.linear(x, w, b)
        return self.shard.all_reduce(y) if self.is_row_parallel else y


def column(
    in_features: int, out_features: int, shard: Shard, *, dtype: torch.dtype, bias: bool = False
) -> Linear:
    return Linear(
        in_features,
        out_features,
        dtype=dtype,
        bias=bias,
        out_range=shard.split(out_features, "out"),
        shard=shard,
    )


def row(
    in_features: int, out_features: int, shard: Shard, *, dtype: torch.dtype, bias: bool = False
) -> Linear:
    return Linear(
        in_features,
        out_features,
        dtype=dtype,
        bias=bias,
        in_range=shard.split(in_features, "in"),
        shard=shard,
    )


def has_bias(parts: Sequence[nn.Module]) -> bool:
    return any(p.bias is not None for p in parts)


def stacked_bias(parts: Sequence[nn.Module], rows: list[int]) -> torch.Tensor:
    """The parts' biases end to end (each of `rows` entries), zeros for a part without one."""
    biases: list[torch.Tensor | None] = [cast(torch.Tensor | None, p.bias) for p in parts]
    like = next(b for b in biases if b is not None)
    return torch.cat([like.new_zeros(n) if b is None else b for b, n in zip(biases, rows, strict=True)])


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))

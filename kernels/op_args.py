"""Argument types shared by an op's dispatcher (`kernels/<op>.py`, importable without triton) and its
Triton module (`kernels/<op>_triton.py`, imported only on CUDA): here, so that neither imports the other
at its top (the dispatcher imports the Triton module lazily; the Triton module reads these types).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MAX_NORMS", "ExpertRoute", "KvLines", "RowNorm"]


@dataclass(frozen=True, slots=True)
class KvLines:
    """Another cache of the same pool written by the same `kv_write` call, at the same slots under the
    same tags."""

    cache: torch.Tensor  # [P, S, *shape2]
    values: torch.Tensor  # [T, *shape2]
    scale: float


MAX_NORMS = 3  # `row_norms`' kernel slots: a DSA layer's q_a, kv_a and indexer key norms


@dataclass(frozen=True, slots=True)
class RowNorm:
    """One norm of a `row_norms` call."""

    x: torch.Tensor  # [N, D] (with `rows`: [V, D], a table), any row stride, unit stride in D
    weight: torch.Tensor  # [D]
    eps: float
    bias: torch.Tensor | None = None  # [D] LayerNorm only
    is_layer_norm: bool = False  # LayerNorm (mean removed, weight and bias), else RMSNorm
    # [N, D], any row stride, unit in D: RMSNorm promote(weight, x) dtype, LayerNorm x's; None: a new tensor
    out: torch.Tensor | None = None
    # [N] int64 / int32: the norm's rows are x's rows `rows` (an embedding lookup in the norm's launch:
    # an MTP depth's token embeddings), every id in [0, V); None: x's own N rows
    rows: torch.Tensor | None = None

    @property
    def num_rows(self) -> int:
        return int(self.x.shape[0] if self.rows is None else self.rows.shape[0])

    def source(self) -> torch.Tensor:
        """The rows this norm reads `[N, D]` (a gather when `rows` is set: `F.embedding`'s)."""
        return self.x if self.rows is None else torch.nn.functional.embedding(self.rows, self.x)


@dataclass(frozen=True, slots=True)
class ExpertRoute:
    """The every-expert MoE's routing, read by `act_mul` to weigh each expert-major row."""

    ids: torch.Tensor  # [N, k] int64 each token's chosen experts (global ids)
    weights: torch.Tensor  # [N, k] float32 their routing weights
    first_expert: int  # e0: row block e holds global expert e0 + e; ids outside [e0, e0 + El) weigh 0

"""Several row norms of one step in one launch: the op's public entry `row_norms(args)` (the Triton
kernel of `kernels/row_norms_triton.py` on CUDA), the torch references elsewhere.

An MLA layer norms two slices of its fused `x` projection, q's LoRA activation and the latent (two
RMSNorms), and a DSA layer a third, its indexer's key (a LayerNorm with bias): one launch a layer where
there were two or three; an MTP depth's two input norms are one launch with the embedding lookup in
it (`RowNorm.rows`: norm 0's rows gathered from the table). Each norm is its own op's math: RMSNorm as
`kernels/rms_norm.py` (without the residual add), LayerNorm as torch's (`F.layer_norm`: mean and
variance in float32, `(x - mean) · rstd · weight + bias` in float32, one rounding to x's dtype), so the
result is each module's up to the sums' order; a gather is exact.

Shapes: N rows (every norm's), D each norm's width.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.op_args import RowNorm
from kernels.rms_norm import rms_norm_ref


@dataclass(frozen=True, slots=True)
class RowNormsArgs:
    norms: tuple[RowNorm, ...]  # 1 to MAX_NORMS, the same N rows


def row_norms(args: RowNormsArgs) -> list[torch.Tensor]:
    """The op → each norm's output [N, D], in order. Triton on CUDA, one launch (triton is the gpu
    extra: imported only there), the references elsewhere."""
    if args.norms[0].x.is_cuda:
        from kernels.row_norms_triton import row_norms_triton

        return row_norms_triton(list(args.norms))
    return [row_norm_ref(n) for n in args.norms]


def row_norm_ref(n: RowNorm) -> torch.Tensor:
    x = n.source()
    if not n.is_layer_norm:
        return rms_norm_ref(x, n.weight, n.eps, out=n.out)[0]
    y = F.layer_norm(x, (x.shape[-1],), n.weight, n.bias, n.eps)
    return y if n.out is None else n.out.copy_(y)

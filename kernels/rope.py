"""Rotary position embedding of the first `dim` dims of each head: the op's public entry
`rope(args)` (the Triton kernel of `kernels/rope_triton.py` on CUDA, one launch for what torch runs
as ~8: four products, a difference, a sum and two concatenations, and for up to four tensors at the
same positions: a DSA layer's four rotations are one launch), the torch reference `rope_ref`
elsewhere.

Interleaved pairs (x0, x1), (x2, x3)… (DeepSeek-style MLA) or NeoX halves (GLM-4.5); either way the
rotated pairs come out as halves `[x1·c − x2·s | x2·c + x1·s]`, and dims past `dim` pass through.
Each product, the difference and the sum round to x's dtype, as torch's elementwise ops do, so the
kernel's bytes are the reference's. `out` may be a slice of a larger buffer (the latent cache line
or the absorbed query), which spares the concatenation the caller would do next.

Shapes: T tokens, Hx heads, Dx head dim (>= dim), dim/2 frequencies.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RopeArgs:
    xs: tuple[torch.Tensor, ...]  # 1 to 4 tensors [T, Hx, Dx] of one dtype (each its own Hx, Dx)
    cos: torch.Tensor  # [T, dim/2] the xs' dtype
    sin: torch.Tensor  # [T, dim/2]
    dim: int  # rotated dims per head, even, <= every Dx
    is_interleaved: bool
    # each x's [T, Hx, Dx] in its dtype, any strides but unit in Dx, overlapping no other tensor of the
    # call; None (all, or one): a new tensor
    outs: tuple[torch.Tensor | None, ...] | None = None


def rope(args: RopeArgs) -> list[torch.Tensor]:  # each [T, Hx, Dx]
    """The op → each x rotated, in order. Triton on CUDA, one launch (triton is the gpu extra: imported
    only there), the reference elsewhere."""
    a = args
    outs = list(a.outs) if a.outs is not None else [None] * len(a.xs)
    if a.xs[0].is_cuda:
        from kernels.rope_triton import rope_many_triton

        return rope_many_triton(list(a.xs), a.cos, a.sin, a.dim, a.is_interleaved, outs)
    return [
        rope_ref(x, a.cos, a.sin, a.dim, a.is_interleaved, out) for x, out in zip(a.xs, outs, strict=True)
    ]


def rope_ref(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    dim: int,
    is_interleaved: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    c, s = cos[:, None, :], sin[:, None, :]
    rot, rest = x[..., :dim], x[..., dim:]
    if is_interleaved:  # pairs (x0, x1), (x2, x3)… come out de-interleaved (evens then odds)
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
    else:
        x1, x2 = rot[..., : dim // 2], rot[..., dim // 2 :]
    y = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
    y = torch.cat([y, rest], dim=-1) if rest.shape[-1] else y
    if out is None:
        return y
    return out.copy_(y)

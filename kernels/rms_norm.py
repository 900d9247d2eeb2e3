"""RMSNorm, optionally after a residual add: the op's public entry `rms_norm(args)` (the Triton kernel
of `kernels/rms_norm_triton.py` on CUDA, one launch for what torch runs as ~8: cast, square, mean,
add eps, rsqrt, scale, cast back, weight), the torch reference `rms_norm_ref` elsewhere.

`h = x + residual` (rounded to x's dtype, as torch adds) when a residual is given, then
`out = weight * (h_f32 · rsqrt(mean(h_f32²) + eps)).to(h.dtype)`: the reference implementations'
order of roundings, so the result is the torch module's up to the mean's summation order.

Shapes: N rows, D the normed dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class RmsNormArgs:
    x: torch.Tensor  # [N, D]
    weight: torch.Tensor  # [D]
    eps: float
    residual: torch.Tensor | None = None  # [N, D] x's dtype, added first; None: no add
    out: torch.Tensor | None = None  # [N, D] promote(weight, x) dtype, any row stride; None: a new tensor


def rms_norm(args: RmsNormArgs) -> tuple[torch.Tensor, torch.Tensor]:
    """The op → (out [N, D], h [N, D]: x + residual, or x itself without a residual). Triton on CUDA
    (triton is the gpu extra: imported only there), the reference elsewhere."""
    run = rms_norm_ref
    if args.x.is_cuda:
        from kernels.rms_norm_triton import rms_norm_triton as run
    return run(args.x, args.weight, args.eps, args.residual, args.out)


def rms_norm_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    h = x if residual is None else x + residual
    hf = h.float()
    hf = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
    y = weight * hf.to(h.dtype)
    if out is None:
        return y, h
    out.copy_(y)
    return out, h

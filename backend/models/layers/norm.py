"""RMSNorm, computed in float32 and cast back, exactly as the reference implementations do; one
kernel launch on CUDA (`kernels/rms_norm.py`), the residual add before it fused when asked."""

from __future__ import annotations

import torch
from torch import nn

from kernels.rms_norm import RmsNormArgs, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, *, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., dim] → normed [..., dim]; written into `out` (a [N, dim] view, e.g. a slice of a
        wider row) when given."""
        y, _ = rms_norm(RmsNormArgs(x.reshape(-1, x.shape[-1]), self.weight, self.eps, out=out))
        return y if out is not None else y.view(x.shape)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x, residual [T, dim] → (the norm of h, h = x + residual): the add and the norm in one launch."""
        return rms_norm(RmsNormArgs(x, self.weight, self.eps, residual=residual))

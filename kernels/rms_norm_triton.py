"""RMSNorm (+ residual add) in one launch, a program per row; the op and its reference are
`kernels/rms_norm.py`.

Shapes: N rows, D the normed dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_launch_dependents, pdl_wait

__all__ = ["rms_norm_triton"]


@triton.jit
def _rms_norm_kernel(
    x_ptr,  # [N, D]
    r_ptr,  # [N, D] x's dtype (HAS_RESIDUAL)
    w_ptr,  # [D]
    out_ptr,  # [N, D]
    h_ptr,  # [N, D] x + residual (HAS_RESIDUAL)
    D,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_h,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): the norm's weight loads before the wait
):
    pdl_launch_dependents(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)  # a weight: constant (rule 2)
    pdl_wait(PDL)
    h = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)  # torch's add: one rounding
        tl.store(h_ptr + row * stride_h + cols, h, mask=mask)
    hf = h.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hf * hf, axis=0) / D + eps)
    y = (hf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)  # the reference casts back before the weight
    tl.store(out_ptr + row * stride_o + cols, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_triton(
    x: torch.Tensor,  # [N, D], unit stride in D
    weight: torch.Tensor,  # [D] contiguous
    eps: float,
    residual: torch.Tensor | None = None,  # [N, D] x's dtype
    out: torch.Tensor | None = None,  # [N, D] promote(weight, x) dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rms_norm_ref` in one launch → (out, h)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [N, D] with unit stride in D, got {tuple(x.shape)} {x.stride()}")
    N, D = x.shape
    if weight.shape != (D,) or weight.stride(0) != 1:
        raise ValueError(f"weight must be contiguous [{D}], got {tuple(weight.shape)}")
    dtype = torch.promote_types(weight.dtype, x.dtype)
    if out is None:
        out = torch.empty((N, D), dtype=dtype, device=x.device)
    elif out.shape != (N, D) or out.dtype != dtype or out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} [{N}, {D}] with unit stride in D")
    h = x
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype or residual.stride(1) != 1:
            raise ValueError("residual must be x's shape and dtype, unit stride in D")
        h = torch.empty((N, D), dtype=x.dtype, device=x.device)
    if N == 0:
        return out, h
    block = triton.next_power_of_2(D)
    _rms_norm_kernel[(N,)](
        x, residual if residual is not None else x, weight, out, h, D, eps,
        x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0), h.stride(0),
        HAS_RESIDUAL=residual is not None, BLOCK_D=block, **pdl_args(x.device),
        num_warps=max(1, min(16, block // 512)),
    )  # fmt: skip
    return out, h

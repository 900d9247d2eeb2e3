"""Rotary embedding in one launch, a program per (token, block of heads); the op and its reference
are `kernels/rope.py`.

Shapes: T tokens, Hx heads, Dx head dim, HALF = dim/2 frequencies, REST = Dx - dim passed through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["rope_triton"]


@triton.jit
def _rope_kernel(
    x_ptr,  # [T, Hx, Dx]
    cos_ptr,  # [T, HALF]
    sin_ptr,  # [T, HALF]
    out_ptr,  # [T, Hx, Dx]
    Hx,
    HALF,
    REST,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    stride_ot,
    stride_oh,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,  # >= HALF
    BLOCK_R: tl.constexpr,  # >= REST (>= 1)
    EXACT: tl.constexpr,  # on the GPU: libdevice's round-to-nearest arithmetic (see below)
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): cos and sin are the step's, read after the wait
):
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    f = tl.arange(0, BLOCK_F)
    fm = f < HALF
    c = tl.load(cos_ptr + t * stride_ct + f, mask=fm, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + f, mask=fm, other=0.0).to(tl.float32)[None, :]
    m = (heads < Hx)[:, None] & fm[None, :]
    x_row = x_ptr + t * stride_xt + heads[:, None] * stride_xh
    if INTERLEAVED:
        i1, i2 = 2 * f, 2 * f + 1
    else:
        i1, i2 = f, f + HALF
    x1 = tl.load(x_row + i1[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + i2[None, :], mask=m, other=0.0).to(tl.float32)
    dt = out_ptr.dtype.element_ty
    # each product and the sum rounded to the dtype, as torch's `x1 * c - x2 * s` does. On the GPU the
    # arithmetic goes through libdevice's `*_rn` (no contraction): with plain operators the compiler
    # narrows the products to bf16 and fuses the second into an FMA with the difference, one rounding
    # fewer than torch (seen in the sm90 PTX: `mul.bf16` + `fma.rn.bf16`; 1 ulp off on the H200). The
    # `*_rn` calls flush fp32 denormals (products below 1e-38), which rotary values never are
    if EXACT:
        p11 = libdevice.mul_rn(x1, c).to(dt).to(tl.float32)
        p22 = libdevice.mul_rn(x2, s).to(dt).to(tl.float32)
        p21 = libdevice.mul_rn(x2, c).to(dt).to(tl.float32)
        p12 = libdevice.mul_rn(x1, s).to(dt).to(tl.float32)
        lo = libdevice.sub_rn(p11, p22).to(dt)
        hi = libdevice.add_rn(p21, p12).to(dt)
    else:  # the interpreter: numpy's arithmetic, no contraction
        lo = ((x1 * c).to(dt).to(tl.float32) - (x2 * s).to(dt).to(tl.float32)).to(dt)
        hi = ((x2 * c).to(dt).to(tl.float32) + (x1 * s).to(dt).to(tl.float32)).to(dt)
    o_row = out_ptr + t * stride_ot + heads[:, None] * stride_oh
    tl.store(o_row + f[None, :], lo, mask=m)
    tl.store(o_row + HALF + f[None, :], hi, mask=m)
    if REST > 0:
        r = tl.arange(0, BLOCK_R)
        rm = (heads < Hx)[:, None] & (r < REST)[None, :]
        rest = tl.load(x_row + 2 * HALF + r[None, :], mask=rm, other=0.0)
        tl.store(o_row + 2 * HALF + r[None, :], rest.to(dt), mask=rm)


def rope_triton(
    x: torch.Tensor,  # [T, Hx, Dx], unit stride in Dx
    cos: torch.Tensor,  # [T, dim/2] x's dtype, unit stride
    sin: torch.Tensor,
    dim: int,
    is_interleaved: bool,
    out: torch.Tensor | None = None,  # [T, Hx, Dx] x's dtype, unit stride in Dx
) -> torch.Tensor:
    """`rope_ref` in one launch."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x must be [T, Hx, Dx] with unit stride in Dx, got {tuple(x.shape)} {x.stride()}")
    T, Hx, Dx = x.shape
    if dim % 2 or not 0 < dim <= Dx:
        raise ValueError(f"dim must be even and in (0, {Dx}], got {dim}")
    half = dim // 2
    for name, v in (("cos", cos), ("sin", sin)):
        if v.shape != (T, half) or v.dtype != x.dtype or v.stride(1) != 1:
            raise ValueError(
                f"{name} must be {x.dtype} [{T}, {half}] with unit stride, got {v.dtype} {tuple(v.shape)}"
            )
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    elif out.shape != x.shape or out.dtype != x.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with unit stride in Dx")
    if T == 0 or Hx == 0:
        return out
    block_f = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(Hx), 4096 // block_f))
    rest = Dx - dim
    _rope_kernel[(T, triton.cdiv(Hx, block_h))](
        x, cos, sin, out, Hx, half, rest, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
        out.stride(0), out.stride(1), INTERLEAVED=is_interleaved, BLOCK_H=block_h, BLOCK_F=block_f,
        BLOCK_R=triton.next_power_of_2(max(rest, 1)), EXACT=x.is_cuda, **pdl_args(x.device), num_warps=4,
    )  # fmt: skip
    return out

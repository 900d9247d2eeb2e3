"""Rotary embedding in one launch, for up to four tensors rotated at the same positions (the MLA
query's and latent's rope dims, the DSA indexer's query and key: one launch a layer, not four); a
program per (token, block of one tensor's heads). The op and its reference are `kernels/rope.py`.

Shapes: T tokens, Hx heads, Dx head dim (each tensor its own), HALF = dim/2 frequencies, REST = Dx - dim
passed through.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["MAX_TENSORS", "rope_many_triton", "rope_triton"]

MAX_TENSORS = 4  # the kernel's tensor slots: a DSA layer's four rotations


@triton.jit
def _rope_heads(
    x_ptr,  # [T, Hx, Dx]
    out_ptr,  # [T, Hx, Dx]
    c,  # [1, BLOCK_F] float32 cos of token t
    s,  # [1, BLOCK_F] float32 sin
    t,
    hb,  # this program's block of heads
    Hx,
    HALF,
    REST,
    stride_xt,
    stride_xh,
    stride_ot,
    stride_oh,
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,
    BLOCK_R: tl.constexpr,
    EXACT: tl.constexpr,
):
    heads = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    f = tl.arange(0, BLOCK_F)
    m = (heads < Hx)[:, None] & (f < HALF)[None, :]
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


@triton.jit
def _rope_kernel(
    cos_ptr,  # [T, HALF]
    sin_ptr,  # [T, HALF]
    x0_ptr,  # [T, H0, D0]: tensor 0; tensors 1-3 likewise, each its own heads, dims and strides
    out0_ptr,  # [T, H0, D0]
    x1_ptr,
    out1_ptr,
    x2_ptr,
    out2_ptr,
    x3_ptr,
    out3_ptr,
    HALF,
    stride_ct,
    stride_st,
    H0, REST0, stride_x0t, stride_x0h, stride_o0t, stride_o0h,
    H1, REST1, stride_x1t, stride_x1h, stride_o1t, stride_o1h,
    H2, REST2, stride_x2t, stride_x2h, stride_o2t, stride_o2h,
    H3, REST3, stride_x3t, stride_x3h, stride_o3t, stride_o3h,
    START1,  # tensor i's head blocks are program_id(1) in [START_i, START_i+1) (START0 = 0, the last ends the grid)
    START2,
    START3,
    NUM_X: tl.constexpr,  # tensors in this launch, 1 to MAX_TENSORS
    INTERLEAVED: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_F: tl.constexpr,  # >= HALF
    BLOCK_R: tl.constexpr,  # >= every REST (>= 1)
    EXACT: tl.constexpr,  # on the GPU: libdevice's round-to-nearest arithmetic (see `_rope_heads`)
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): cos and sin are the step's, read after the wait
):  # fmt: skip
    pdl_enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    b = tl.program_id(1)
    f = tl.arange(0, BLOCK_F)
    fm = f < HALF
    c = tl.load(cos_ptr + t * stride_ct + f, mask=fm, other=0.0).to(tl.float32)[None, :]
    s = tl.load(sin_ptr + t * stride_st + f, mask=fm, other=0.0).to(tl.float32)[None, :]
    if b < START1:
        _rope_heads(
            x0_ptr, out0_ptr, c, s, t, b, H0, HALF, REST0, stride_x0t, stride_x0h, stride_o0t, stride_o0h,
            INTERLEAVED, BLOCK_H, BLOCK_F, BLOCK_R, EXACT,
        )  # fmt: skip
    if NUM_X > 1:  # noqa: SIM102 (a constexpr: a launch of fewer tensors compiles no branch)
        if (b >= START1) & (b < START2):
            _rope_heads(
                x1_ptr, out1_ptr, c, s, t, b - START1, H1, HALF, REST1, stride_x1t, stride_x1h, stride_o1t,
                stride_o1h, INTERLEAVED, BLOCK_H, BLOCK_F, BLOCK_R, EXACT,
            )  # fmt: skip
    if NUM_X > 2:  # noqa: SIM102 (a constexpr: a launch of fewer tensors compiles no branch)
        if (b >= START2) & (b < START3):
            _rope_heads(
                x2_ptr, out2_ptr, c, s, t, b - START2, H2, HALF, REST2, stride_x2t, stride_x2h, stride_o2t,
                stride_o2h, INTERLEAVED, BLOCK_H, BLOCK_F, BLOCK_R, EXACT,
            )  # fmt: skip
    if NUM_X > 3:  # noqa: SIM102 (a constexpr: a launch of fewer tensors compiles no branch)
        if b >= START3:
            _rope_heads(
                x3_ptr, out3_ptr, c, s, t, b - START3, H3, HALF, REST3, stride_x3t, stride_x3h, stride_o3t,
                stride_o3h, INTERLEAVED, BLOCK_H, BLOCK_F, BLOCK_R, EXACT,
            )  # fmt: skip


def _checked_out(x: torch.Tensor, out: torch.Tensor | None, dim: int) -> torch.Tensor:
    """x's output buffer (a new one for None), after checking both."""
    if x.dim() != 3 or x.stride(2) != 1:
        raise ValueError(f"x must be [T, Hx, Dx] with unit stride in Dx, got {tuple(x.shape)} {x.stride()}")
    if dim % 2 or not 0 < dim <= x.shape[2]:
        raise ValueError(f"dim must be even and in (0, {x.shape[2]}], got {dim}")
    if out is None:
        return torch.empty_like(x, memory_format=torch.contiguous_format)
    if out.shape != x.shape or out.dtype != x.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be {x.dtype} {tuple(x.shape)} with unit stride in Dx")
    return out


def rope_many_triton(
    xs: list[torch.Tensor],  # each [T, Hx, Dx], unit stride in Dx, one dtype
    cos: torch.Tensor,  # [T, dim/2] the xs' dtype, unit stride
    sin: torch.Tensor,
    dim: int,
    is_interleaved: bool,
    outs: list[torch.Tensor | None],  # each [T, Hx, Dx] its x's dtype, unit stride in Dx; None: new
) -> list[torch.Tensor]:
    """`rope_ref` of each x in one launch (an out may not overlap another tensor of the launch)."""
    if not 0 < len(xs) <= MAX_TENSORS or len(outs) != len(xs):
        raise ValueError(f"1 to {MAX_TENSORS} tensors and one out each, got {len(xs)} and {len(outs)}")
    T, half = xs[0].shape[0], dim // 2
    outs = [_checked_out(x, out, dim) for x, out in zip(xs, outs, strict=True)]
    if any(x.shape[0] != T or x.dtype != xs[0].dtype for x in xs):
        raise ValueError("every x must have the first one's tokens and dtype")
    for name, v in (("cos", cos), ("sin", sin)):
        if v.shape != (T, half) or v.dtype != xs[0].dtype or v.stride(1) != 1:
            raise ValueError(
                f"{name} must be {xs[0].dtype} [{T}, {half}] with unit stride, got {v.dtype} {tuple(v.shape)}"
            )
    live = [(x, out) for x, out in zip(xs, outs, strict=True) if x.shape[1]]
    if T == 0 or not live:
        return outs
    block_f = triton.next_power_of_2(half)
    block_h = max(1, min(triton.next_power_of_2(max(x.shape[1] for x, _ in live)), 4096 // block_f))
    block_r = triton.next_power_of_2(max(1, *(x.shape[2] - dim for x, _ in live)))
    starts = [0]
    for x, _ in live:
        starts.append(starts[-1] + triton.cdiv(x.shape[1], block_h))
    starts += [starts[-1]] * (MAX_TENSORS + 1 - len(starts))  # unused slots start at the grid's end
    slots = live + [live[0]] * (MAX_TENSORS - len(live))  # placeholders the NUM_X branches never read
    ptrs = [p for x, out in slots for p in (x, out)]
    geometry = [
        v for x, out in slots for v in (x.shape[1], x.shape[2] - dim, x.stride(0), x.stride(1), out.stride(0), out.stride(1))
    ]  # fmt: skip
    _rope_kernel[(T, starts[len(live)])](
        cos, sin, *ptrs, half, cos.stride(0), sin.stride(0), *geometry, *starts[1:MAX_TENSORS],
        NUM_X=len(live), INTERLEAVED=is_interleaved, BLOCK_H=block_h, BLOCK_F=block_f, BLOCK_R=block_r,
        EXACT=xs[0].is_cuda, **pdl_args(xs[0].device), num_warps=4,
    )  # fmt: skip
    return outs


def rope_triton(
    x: torch.Tensor,  # [T, Hx, Dx], unit stride in Dx
    cos: torch.Tensor,  # [T, dim/2] x's dtype, unit stride
    sin: torch.Tensor,
    dim: int,
    is_interleaved: bool,
    out: torch.Tensor | None = None,  # [T, Hx, Dx] x's dtype, unit stride in Dx
) -> torch.Tensor:
    """`rope_ref` in one launch."""
    return rope_many_triton([x], cos, sin, dim, is_interleaved, [out])[0]

"""SiLU(gate) · up in one launch (the op and its reference are `kernels/act_mul.py`): a program per
(row, BLOCK columns), so a decode row of a few thousand columns spreads over several SMs.

Shapes: T rows, I columns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["silu_mul_triton"]

BLOCK = 1024  # columns a program: one 16-byte load a thread at 4 warps in bf16 (I is 2,048-18,432 here)


@triton.jit
def _silu_mul_kernel(
    g_ptr,  # [T, I]
    u_ptr,  # [T, I]
    out_ptr,  # [T, I] contiguous
    I,
    stride_g,
    stride_u,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): reads nothing before the wait
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(g_ptr + row * stride_g + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * stride_u + cols, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(g_ptr.dtype.element_ty).to(tl.float32)  # F.silu's result, rounded
    tl.store(out_ptr + row * I + cols, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """`F.silu(gate) * up` in one launch → [T, I] contiguous, gate's dtype."""
    if gate.dim() != 2 or gate.stride(1) != 1 or up.shape != gate.shape or up.stride(1) != 1:
        raise ValueError(
            f"gate and up must be [T, I] with unit stride in I, got {tuple(gate.shape)}, {tuple(up.shape)}"
        )
    if up.dtype != gate.dtype:
        raise ValueError(f"up must be gate's dtype {gate.dtype}, got {up.dtype}")
    T, I = gate.shape
    out = torch.empty((T, I), dtype=gate.dtype, device=gate.device)
    if T and I:
        _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](
            gate, up, out, I, gate.stride(0), up.stride(0), BLOCK=BLOCK, num_warps=4, **pdl_args(gate.device)
        )
    return out

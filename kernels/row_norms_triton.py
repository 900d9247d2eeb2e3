"""Up to three row norms in one launch, a program per (row, norm), a norm's rows read in place or
gathered from a table by id (`RowNorm.rows`); the op and its references are `kernels/row_norms.py`.

Shapes: N rows, D0..D2 the norms' widths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.op_args import MAX_NORMS, RowNorm
from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["row_norms_triton"]


@triton.jit
def _norm_row(
    x_ptr,  # [N, D] (GATHER: [V, D])
    w_ptr,  # [D]
    b_ptr,  # [D] (LAYER)
    out_ptr,  # [N, D]
    rows_ptr,  # [N] x's row of each output row (GATHER)
    row,
    D,
    eps,
    stride_x,
    stride_o,
    BLOCK_D: tl.constexpr,
    LAYER: tl.constexpr,  # LayerNorm, else RMSNorm
    GATHER: tl.constexpr,  # read x's row rows[row] (an embedding lookup), else x's row `row`
):
    cols = tl.arange(0, BLOCK_D)
    mask = cols < D
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    src = tl.load(rows_ptr + row).to(tl.int64) if GATHER else row
    xf = tl.load(x_ptr + src * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if LAYER:  # torch's: float32 throughout, one rounding at the end
        mean = tl.sum(xf, axis=0) / D
        xc = tl.where(mask, xf - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / D + eps)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        y = xc * rstd * w + b
    else:  # `kernels/rms_norm.py`'s: cast back to x's dtype before the weight
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / D + eps)
        y = w * (xf * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + row * stride_o + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_norms_kernel(
    x0_ptr,  # [N, D0] (GATHER0: [V, D0]): norm 0; norms 1 and 2 likewise
    w0_ptr,  # [D0]
    b0_ptr,  # [D0] (LAYER0), else a placeholder
    out0_ptr,  # [N, D0]
    rows0_ptr,  # [N] (GATHER0), else a placeholder
    x1_ptr,
    w1_ptr,
    b1_ptr,
    out1_ptr,
    rows1_ptr,
    x2_ptr,
    w2_ptr,
    b2_ptr,
    out2_ptr,
    rows2_ptr,
    D0, eps0, stride_x0, stride_o0,
    D1, eps1, stride_x1, stride_o1,
    D2, eps2, stride_x2, stride_o2,
    NUM: tl.constexpr,  # norms in this launch, 1 to MAX_NORMS
    BLOCK_D0: tl.constexpr,
    BLOCK_D1: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    LAYER0: tl.constexpr,
    LAYER1: tl.constexpr,
    LAYER2: tl.constexpr,
    GATHER0: tl.constexpr,
    GATHER1: tl.constexpr,
    GATHER2: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):  # fmt: skip
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    which = tl.program_id(1)
    if which == 0:
        _norm_row(x0_ptr, w0_ptr, b0_ptr, out0_ptr, rows0_ptr, row, D0, eps0, stride_x0, stride_o0, BLOCK_D0,
                  LAYER0, GATHER0)  # fmt: skip
    if NUM > 1:  # noqa: SIM102 (a constexpr: a launch of fewer norms compiles no branch)
        if which == 1:
            _norm_row(x1_ptr, w1_ptr, b1_ptr, out1_ptr, rows1_ptr, row, D1, eps1, stride_x1, stride_o1, BLOCK_D1,
                      LAYER1, GATHER1)  # fmt: skip
    if NUM > 2:  # noqa: SIM102
        if which == 2:
            _norm_row(x2_ptr, w2_ptr, b2_ptr, out2_ptr, rows2_ptr, row, D2, eps2, stride_x2, stride_o2, BLOCK_D2,
                      LAYER2, GATHER2)  # fmt: skip


def _checked_out(n: RowNorm, N: int) -> torch.Tensor:
    """Norm n's output buffer (a new one for None), after checking its operands."""
    if n.rows is not None and (
        n.rows.shape != (N,) or n.rows.dtype not in (torch.int32, torch.int64) or n.rows.stride(0) != 1
    ):
        raise ValueError(f"rows must be a contiguous int [{N}], got {tuple(n.rows.shape)} {n.rows.dtype}")
    if n.x.dim() != 2 or (n.rows is None and n.x.shape[0] != N) or n.x.stride(1) != 1:
        rows = "V" if n.rows is not None else N
        raise ValueError(
            f"x must be [{rows}, D] with unit stride in D, got {tuple(n.x.shape)} {n.x.stride()}"
        )
    D = n.x.shape[1]
    operands = [("weight", n.weight)] + ([("bias", n.bias)] if n.is_layer_norm else [])
    for name, v in operands:
        if v is None or v.shape != (D,) or v.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous [{D}], got {None if v is None else tuple(v.shape)}")
    dtype = n.x.dtype if n.is_layer_norm else torch.promote_types(n.weight.dtype, n.x.dtype)
    if n.out is None:
        return torch.empty((N, D), dtype=dtype, device=n.x.device)
    if n.out.shape != (N, D) or n.out.dtype != dtype or n.out.stride(1) != 1:
        raise ValueError(f"out must be {dtype} [{N}, {D}] with unit stride in D")
    return n.out


def row_norms_triton(norms: list[RowNorm]) -> list[torch.Tensor]:
    """`row_norm_ref` of each norm in one launch (an out may not overlap another norm's x)."""
    if not 0 < len(norms) <= MAX_NORMS:
        raise ValueError(f"1 to {MAX_NORMS} norms, got {len(norms)}")
    N = norms[0].num_rows
    outs = [_checked_out(n, N) for n in norms]
    if N == 0:
        return outs
    slots = list(zip(norms, outs, strict=True))
    slots += [slots[0]] * (MAX_NORMS - len(slots))  # placeholders the NUM branches never read
    ptrs = [
        p
        for n, out in slots
        for p in (
            n.x,
            n.weight,
            n.bias if n.bias is not None else n.weight,
            out,
            n.rows if n.rows is not None else out,
        )
    ]
    geometry = [v for n, out in slots for v in (n.x.shape[1], n.eps, n.x.stride(0), out.stride(0))]
    blocks = [triton.next_power_of_2(n.x.shape[1]) for n, _ in slots]
    gather = [i < len(norms) and n.rows is not None for i, (n, _) in enumerate(slots)]  # placeholders: off
    _row_norms_kernel[(N, len(norms))](
        *ptrs, *geometry, NUM=len(norms), BLOCK_D0=blocks[0], BLOCK_D1=blocks[1], BLOCK_D2=blocks[2],
        LAYER0=slots[0][0].is_layer_norm, LAYER1=slots[1][0].is_layer_norm, LAYER2=slots[2][0].is_layer_norm,
        GATHER0=gather[0], GATHER1=gather[1], GATHER2=gather[2],
        **pdl_args(norms[0].x.device), num_warps=max(1, min(16, max(blocks[: len(norms)]) // 512)),
    )  # fmt: skip
    return outs

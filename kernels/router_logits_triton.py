"""The MoE gate's GEMV in one launch (the op and its reference are `kernels/router_logits.py`): a
program per (BLOCK_E experts, token) streams its float32 weight rows along H, widening x as it loads
it, and sums each row in a fixed order (deterministic: no atomics, no split of H).

Shapes: T tokens, H hidden, E experts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_lib import pdl_args, pdl_launch_dependents, pdl_wait, prefetch_l2

__all__ = ["router_logits_triton"]

BLOCK_E = 2  # expert rows a program: E = 256 → 128 programs a token, about one an SM on the H200
BLOCK_H = 1024  # hidden columns a step: one 16-byte float32 load a thread and row at 4 warps


@triton.jit
def _router_logits_kernel(
    x_ptr,  # [T, H] bf16 / fp16 / fp32
    w_ptr,  # [E, H] float32
    out_ptr,  # [T, E] float32
    E,
    H,
    stride_xt,
    stride_we,
    stride_ot,
    BLOCK_E: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    PDL: tl.constexpr,  # launched with PDL: the weight's first tile goes to L2 before the wait
):
    """grid (cdiv(E, BLOCK_E), T): out[t, rows] = Σ_h x[t, h] · w[rows, h], float32."""
    pdl_launch_dependents(PDL)
    t = tl.program_id(1).to(tl.int64)
    rows = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)  # [BE]
    rows_ok = rows < E
    cols = tl.arange(0, BLOCK_H)  # [BH]
    w_rows = w_ptr + rows[:, None].to(tl.int64) * stride_we  # [BE, 1]
    if PDL:  # the weight is constant (rule 2): one prefetch per 128-byte line of its first tile
        lines = tl.arange(0, BLOCK_H // 32) * 32
        prefetch_l2(w_rows + lines[None, :], rows_ok[:, None] & (lines < H)[None, :])
    pdl_wait(PDL)
    acc = tl.zeros((BLOCK_E, BLOCK_H), dtype=tl.float32)
    for k in tl.range(0, H, BLOCK_H, num_stages=NUM_STAGES):
        c = k + cols
        c_ok = c < H
        w = tl.load(w_rows + c[None, :], mask=rows_ok[:, None] & c_ok[None, :], other=0.0)
        xv = tl.load(x_ptr + t * stride_xt + c, mask=c_ok, other=0.0).to(tl.float32)
        acc += w * xv[None, :]
    tl.store(out_ptr + t * stride_ot + rows, tl.sum(acc, axis=1), mask=rows_ok)


def router_logits_triton(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`x.float() @ weight.T` in one launch → [T, E] float32 contiguous."""
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"x [T, H] and weight [E, H] do not fit: {tuple(x.shape)}, {tuple(weight.shape)}")
    if x.stride(1) != 1 or weight.stride(1) != 1:
        raise ValueError("x and weight must have unit stride in H")
    if weight.dtype != torch.float32 or x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"x bf16 / fp16 / fp32 and a float32 weight, got {x.dtype} / {weight.dtype}")
    (T, H), E = x.shape, weight.shape[0]
    out = torch.empty((T, E), dtype=torch.float32, device=x.device)
    if T and E:
        _router_logits_kernel[(triton.cdiv(E, BLOCK_E), T)](
            x, weight, out, E, H, x.stride(0), weight.stride(0), out.stride(0), BLOCK_E=BLOCK_E,
            BLOCK_H=BLOCK_H, NUM_STAGES=3, **pdl_args(x.device), num_warps=4,
        )  # fmt: skip
    return out

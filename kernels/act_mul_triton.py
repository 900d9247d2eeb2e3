"""SiLU(gate) · up in one launch (the op and its reference are `kernels/act_mul.py`): a program per
(row, BLOCK columns), so a decode row of a few thousand columns spreads over several SMs. With a
route, each row's product is weighted by its expert's routing weight for its token, summed off the
token's k chosen ids (`ROUTED`).

Shapes: T rows (El·N expert-major with a route), I columns, N tokens, k experts a token.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.op_args import ExpertRoute
from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["silu_mul_triton"]

BLOCK = 1024  # columns a program: one 16-byte load a thread at 4 warps in bf16 (I is 2,048-18,432 here)


@triton.jit
def _silu_mul_kernel(
    g_ptr,  # [T, I]
    u_ptr,  # [T, I]
    out_ptr,  # [T, I] contiguous
    ids_ptr,  # [N, K] int64 (ROUTED)
    w_ptr,  # [N, K] float32 (ROUTED)
    I,
    stride_g,
    stride_u,
    N,
    first_expert,
    stride_ids,
    stride_w,
    K: tl.constexpr,
    ROUTED: tl.constexpr,
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
    out = (s * u).to(out_ptr.dtype.element_ty)
    if ROUTED:  # row e·N + t: expert first_expert + e's weight for token t, 0 if t did not choose it
        e, t = row // N, row % N
        w = 0.0
        for j in tl.static_range(K):
            chosen = tl.load(ids_ptr + t * stride_ids + j) == first_expert + e
            w += tl.where(chosen, tl.load(w_ptr + t * stride_w + j), 0.0)
        out = (out.to(tl.float32) * w).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row * I + cols, out, mask=mask)


def silu_mul_triton(gate: torch.Tensor, up: torch.Tensor, route: ExpertRoute | None = None) -> torch.Tensor:
    """`F.silu(gate) * up` in one launch → [T, I] contiguous, gate's dtype; weighted by `route`
    (`kernels/act_mul.py`) when given."""
    if gate.dim() != 2 or gate.stride(1) != 1 or up.shape != gate.shape or up.stride(1) != 1:
        raise ValueError(
            f"gate and up must be [T, I] with unit stride in I, got {tuple(gate.shape)}, {tuple(up.shape)}"
        )
    if up.dtype != gate.dtype:
        raise ValueError(f"up must be gate's dtype {gate.dtype}, got {up.dtype}")
    T, I = gate.shape
    N, K = route.ids.shape if route is not None else (1, 1)
    if route is not None and (
        route.weights.shape != (N, K)
        or route.weights.dtype != torch.float32
        or (N and T % N)
        or (K > 1 and (route.ids.stride(1) != 1 or route.weights.stride(1) != 1))
    ):
        raise ValueError(
            f"a route's ids and weights must be [N, k] (float32 weights, unit stride in k) and T a "
            f"multiple of N, got {T} rows, N {N}"
        )
    out = torch.empty((T, I), dtype=gate.dtype, device=gate.device)
    if T and I:
        ids, w = (route.ids, route.weights) if route is not None else (out, out)
        _silu_mul_kernel[(T, triton.cdiv(I, BLOCK))](
            gate, up, out, ids, w, I, gate.stride(0), up.stride(0), N,
            route.first_expert if route is not None else 0, ids.stride(0), w.stride(0),
            K=K, ROUTED=route is not None, BLOCK=BLOCK, num_warps=4, **pdl_args(gate.device),
        )  # fmt: skip
    return out

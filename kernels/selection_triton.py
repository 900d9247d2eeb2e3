"""`top_positions(scores, k, best_first=False)` (kernels/selection.py) on the GPU with fewer
launches: one kernel turns the scores into their int64 keys (what torch built in ten elementwise
ops), `topk` picks the k largest unsorted, and the picks' own keys say which scores were -inf (no
gather of the scores back). Same keys, same `topk`: the same positions in the same order as the
reference on the same device.

Shapes: R rows, L columns, k picks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["top_positions_triton"]

# keys below this are -inf scores: -inf's order-preserving bits are 0xFF800000 ^ 0x7FFFFFFF
NEG_INF_KEY_END = (-(2**31) + 0x7FFFFF + 1) << 32


@triton.jit
def _selection_keys_kernel(
    scores_ptr,  # [R, L] fp32
    keys_ptr,  # [R, L] int64
    L,
    stride_s,
    stride_k,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # rows on axis 0: a long prefill chunk may have > 65535
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < L
    s = tl.load(scores_ptr + row * stride_s + cols, mask=mask, other=0.0)
    bits = s.to(tl.int32, bitcast=True)
    bits = tl.where(bits == -(2**31), 0, bits)  # -0.0 → +0.0, as the reference's `+ 0.0`
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # int order = float order
    key = ordered.to(tl.int64) * 4294967296 + (4294967295 - cols.to(tl.int64))
    tl.store(keys_ptr + row * stride_k + cols, key, mask=mask)


def top_positions_triton(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, L] float32 (-inf: not visible) → [R, k] int64 positions, unsorted, -1 for -inf."""
    if scores.dim() != 2 or scores.dtype != torch.float32 or scores.stride(1) != 1:
        raise ValueError(
            f"scores must be float32 [R, L] with unit-stride rows, got {scores.dtype} {tuple(scores.shape)}"
        )
    R, L = scores.shape
    if not 0 < k <= L:
        raise ValueError(f"k must be in [1, {L}], got {k}")
    if k == L:  # every column chosen: -1 where not visible
        return torch.where(scores == float("-inf"), -1, torch.arange(L, device=scores.device))
    keys = torch.empty((R, L), dtype=torch.int64, device=scores.device)
    if R:
        block = 1024
        _selection_keys_kernel[(R, triton.cdiv(L, block))](
            scores, keys, L, scores.stride(0), keys.stride(0), BLOCK=block, num_warps=4
        )
    values, chosen = keys.topk(k, dim=-1, sorted=False)
    return torch.where(values < NEG_INF_KEY_END, -1, chosen)

"""A greedy verify's tail in two launches (the op and its reference are `kernels/verify_accept.py`).

1. `_row_argmax_kernel`, a program per (row, slice of the vocabulary): the slice's largest logit
   and its smallest id, the row's banned ids at -inf. A few rows of a large vocabulary (one
   sequence, L = 4 rows of 154k ids) spread over the SMs; a small vocabulary is one slice a row.
2. `_accept_kernel`, a program per sequence: each row's argmax from its slices (the largest value,
   its smallest id: the first maximum, as torch's), the leading drafts equal to them, the row of
   the last accepted position.

Shapes: B sequences, L rows each (N = B·L), V vocabulary, P slices a row, S banned ids a row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["verify_accept_triton"]

BLOCK_V = 1024
# slices a row: enough programs for every SM twice over, each at least a block of the vocabulary
PROGRAMS_WANTED = 264


@triton.jit
def _row_argmax_kernel(
    logits_ptr,  # [N, V] float32 / bf16
    guards_ptr,  # [B, L, S] int64, -1 padded, unit stride in S (a verify graph's: a slice of a wider buffer)
    val_ptr,  # [N, P] float32 out
    idx_ptr,  # [N, P] int64 out
    V,
    P,
    slice_len,  # ids a slice (a multiple of BLOCK_V)
    stride_row,
    L,
    stride_gb,
    stride_gl,
    S: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    banned_ptr = guards_ptr + (row // L) * stride_gb + (row % L) * stride_gl  # row b·L + i: guards[b, i]
    lanes = tl.arange(0, BLOCK_V)
    best = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    best_id = tl.full((BLOCK_V,), 2147483647, tl.int32)  # none yet
    begin = part * slice_len
    for start in range(0, slice_len, BLOCK_V):  # the last slice's blocks past V load nothing
        cols = begin + start + lanes
        inside = cols < V
        x = tl.load(logits_ptr + row * stride_row + cols, mask=inside, other=float("-inf")).to(tl.float32)
        x = tl.where(x != x, float("inf"), x)  # NaN ranks as +inf
        for s in tl.static_range(S):  # the row's banned ids (a -1 bans nothing)
            x = tl.where(cols == tl.load(banned_ptr + s), float("-inf"), x)
        # strictly larger wins (an earlier id keeps a tie); a lane's first id is taken whatever it is
        take = inside & ((x > best) | (best_id == 2147483647))
        best = tl.where(take, x, best)
        best_id = tl.where(take, cols, best_id)
    top = tl.max(best, axis=0)
    top_id = tl.min(tl.where(best == top, best_id, 2147483647), axis=0)
    tl.store(val_ptr + row * P + part, top)
    tl.store(idx_ptr + row * P + part, top_id.to(tl.int64))


@triton.jit
def _accept_kernel(
    val_ptr,  # [N, P] float32
    idx_ptr,  # [N, P] int64 (2147483647: a slice past the vocabulary)
    ids_ptr,  # [N] int64 the verify's input ids
    query_start_ptr,  # [B + 1] int32
    targets_ptr,  # [B, L] int64 out
    accepted_ptr,  # [B] int64 out
    last_ptr,  # [B] int64 out
    P,
    L: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    p = tl.arange(0, BLOCK_P)
    accepted = tl.zeros((), tl.int64)
    still = tl.full((), 1, tl.int64)  # every draft so far accepted
    for i in tl.static_range(L):
        row = b * L + i
        vals = tl.load(val_ptr + row * P + p, mask=p < P, other=float("-inf"))
        ids = tl.load(idx_ptr + row * P + p, mask=p < P, other=2147483647)
        top = tl.max(vals, axis=0)
        target = tl.min(tl.where(vals == top, ids, 2147483647), axis=0)
        tl.store(targets_ptr + row, target)
        if i < L - 1:
            draft = tl.load(ids_ptr + row + 1)
            still = still * (draft == target).to(tl.int64)
            accepted += still
    tl.store(accepted_ptr + b, accepted)
    tl.store(last_ptr + b, tl.load(query_start_ptr + b).to(tl.int64) + accepted)


def slices_per_row(rows: int, vocab: int) -> tuple[int, int]:
    """(P, ids a slice): the vocabulary's slices a row, each whole blocks, none empty (a function of
    the shape alone, so a captured graph's launch is the eager one's)."""
    wanted = max(1, min(triton.cdiv(vocab, BLOCK_V), triton.cdiv(PROGRAMS_WANTED, max(rows, 1))))
    slice_len = triton.cdiv(triton.cdiv(vocab, wanted), BLOCK_V) * BLOCK_V
    return triton.cdiv(vocab, slice_len), slice_len


def verify_accept_triton(
    logits: torch.Tensor,  # [N, V] float32 / bf16, unit stride in V
    guards: torch.Tensor,  # [B, L, S] int64
    input_ids: torch.Tensor,  # [N] int64
    query_start: torch.Tensor,  # [B + 1] int32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(targets [B, L], accepted [B], last [B]), int64: `verify_accept_ref`'s, in two launches."""
    B, L, S = guards.shape
    N, V = logits.shape
    if N != B * L or logits.stride(1) != 1:
        raise ValueError(f"logits must be [{B * L}, V] with unit stride in V, got {tuple(logits.shape)}")
    if guards.dtype != torch.int64 or guards.stride(2) != 1:
        raise ValueError("guards must be int64 [B, L, S] with unit stride in S")
    if input_ids.shape != (N,) or input_ids.dtype != torch.int64:
        raise ValueError(f"input_ids must be int64 [{N}]")
    if query_start.shape[0] < B + 1:
        raise ValueError(f"query_start must hold B + 1 = {B + 1} entries")
    dev = logits.device
    targets = torch.empty((B, L), dtype=torch.int64, device=dev)
    accepted = torch.empty(B, dtype=torch.int64, device=dev)
    last = torch.empty(B, dtype=torch.int64, device=dev)
    if B == 0:
        return targets, accepted, last
    P, slice_len = slices_per_row(N, V)
    val = torch.empty((N, P), dtype=torch.float32, device=dev)
    idx = torch.empty((N, P), dtype=torch.int64, device=dev)
    _row_argmax_kernel[(N, P)](
        logits, guards, val, idx, V, P, slice_len, logits.stride(0), L, guards.stride(0), guards.stride(1),
        S=S, BLOCK_V=BLOCK_V,
    )  # fmt: skip
    _accept_kernel[(B,)](
        val, idx, input_ids, query_start, targets, accepted, last, P,
        L=L, BLOCK_P=max(triton.next_power_of_2(P), 2),
    )  # fmt: skip
    return targets, accepted, last

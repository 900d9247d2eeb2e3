"""Top-k selection with a defined choice for ties, shared by the DSA indexer's reference and its
Triton path (pure torch: the reference must import without triton)."""

from __future__ import annotations

import torch


def top_positions(scores: torch.Tensor, k: int, *, best_first: bool = True) -> torch.Tensor:
    """scores [R, L] float32 (-inf: not visible) → [R, k] int64 positions, -1 for -inf.

    The choice is by score, then by position (earlier first), so it is a function of the scores
    alone: each score becomes an int64 key `(score's bits, order-preserving) << 32 | (2³² − 1 − j)`,
    unique per column, and `topk` over unique keys has one answer on every device and row length.
    `best_first`: the chosen positions ordered by key (the reference's order); otherwise in the
    order `topk` leaves them unsorted (the same set: consumers that take the positions as a set,
    sparse MLA, skip the sort), and with k >= L every position, no selection run at all.
    """
    L = scores.shape[-1]
    positions = torch.arange(L, device=scores.device)
    if k >= L and not best_first:  # every column chosen: -1 where not visible
        return torch.where(scores == float("-inf"), -1, positions)
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 (a negative weight times relu's 0) → +0.0
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # int order = float order
    keys.mul_(1 << 32).add_(0xFFFFFFFF - positions)  # [R, L]; |bits| < 2³¹: no overflow
    chosen = keys.topk(k, dim=-1, sorted=best_first).indices  # [R, k]
    return torch.where(scores.gather(-1, chosen) == float("-inf"), -1, chosen)

"""Top-k selection with a defined order for ties, shared by the DSA indexer's reference and its
Triton path (pure torch: the reference must import without triton)."""

from __future__ import annotations

import torch


def top_positions(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [R, L] float32 (-inf: not visible) → [R, k] int64 positions, best first, -1 for -inf.

    Ordered by score, then by position (earlier first), so the choice is a function of the scores
    alone: each score becomes an int64 key `(score's bits, order-preserving) << 32 | (2³² − 1 − j)`,
    unique per column, and `topk` over unique keys has one answer on every device and row length.
    """
    bits = (scores + 0.0).view(torch.int32)  # + 0.0: -0.0 (a negative weight times relu's 0) → +0.0
    keys = torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)  # int order = float order
    positions = torch.arange(scores.shape[-1], device=scores.device)
    keys.mul_(1 << 32).add_(0xFFFFFFFF - positions)  # [R, L]; |bits| < 2³¹: no overflow
    chosen = keys.topk(k, dim=-1).indices  # [R, k]
    return torch.where(scores.gather(-1, chosen) == float("-inf"), -1, chosen)

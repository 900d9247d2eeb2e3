"""Rotary position embeddings: default, linear and YaRN frequencies; interleaved or NeoX rotation.

DeepSeek-style MLA rotates interleaved pairs (x0, x1), (x2, x3)…; GLM-4.5 rotates NeoX halves of the
first `dim` dims of each head (partial rotary). YaRN scales cos/sin by its attention factor here; the
MLA softmax mscale² factor lives in `ModelConfig.softmax_scale`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from backend.models.model_config import RopeConfig, yarn_mscale
from kernels.rope import RopeArgs, rope


def inv_freq_and_factor(rope: RopeConfig) -> tuple[torch.Tensor, float]:
    """`inv_freq [dim/2]` float32 and the factor cos/sin are multiplied by."""
    dim, base = rope.dim, rope.theta
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.rope_type == "default":
        return 1.0 / pos_freqs, 1.0
    if rope.rope_type == "linear":
        return 1.0 / pos_freqs / rope.factor, 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(rope.original_max_position_embeddings / (num_rotations * 2 * math.pi))) / (
            2 * math.log(base)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1 on the high-frequency dims, which keep their original frequency
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class Rotary(nn.Module):
    inv_freq: torch.Tensor

    def __init__(self, rope: RopeConfig) -> None:
        super().__init__()
        inv_freq, self.attention_factor = inv_freq_and_factor(rope)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.is_interleaved = rope.is_interleaved
        self.dim = rope.dim
        # per (dtype, device): the tables made, the widest last; none is dropped while the model
        # lives (a captured graph reads the table it was captured with)
        self._tables: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}

    def prepare_table(self, num_positions: int, dtype: torch.dtype, device: torch.device | str) -> None:
        """Precompute cos and sin of positions 0 … num_positions − 1 (`[N, 2, dim/2]`, 2·N·dim
        bytes in bf16: 34 MB for Kimi K2's 262,144 positions), so that `cos_sin` of those positions
        is one gather (one launch, where computing them is six: a nano model's step is launch-bound).
        The values are `cos_sin`'s own: the same elementwise ops over the same float32 inputs (on
        CUDA, bit for bit). A wider table than any made so far is made anew; narrower asks keep it."""
        key = (dtype, torch.device(device))
        tables = self._tables.setdefault(key, [])
        if tables and tables[-1].shape[0] >= num_positions:
            return
        cos, sin = self._compute(torch.arange(num_positions, device=device), dtype)
        tables.append(torch.stack([cos, sin], dim=1))

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] → cos, sin [T, dim/2] (already scaled by the attention factor): gathered
        from the prepared table when there is one for this dtype and device (unit stride in dim/2,
        rows 2·dim/2 apart; every position must be below its width), else computed."""
        tables = self._tables.get((dtype, positions.device))
        if tables:
            both = tables[-1][positions]  # [T, 2, dim/2]: one launch
            return both[:, 0], both[:, 1]
        return self._compute(positions, dtype)

    def _compute(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:  # YaRN's (a factor of 1 would cost two launches a step)
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        return cos.to(dtype), sin.to(dtype)

    def rotate(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """x [T, heads, >= dim]; rotates the first `dim` dims of each head, passes the rest through
        (one launch on CUDA, `kernels/rope.py`); into `out` (e.g. a slice of a wider buffer) when given.
        Interleaved pairs (x0, x1), (x2, x3)… come out de-interleaved (evens then odds), the same for q and k."""
        return rope(RopeArgs((x,), cos, sin, self.dim, self.is_interleaved, (out,)))[0]

    def rotate_many(
        self, pairs: list[tuple[torch.Tensor, torch.Tensor | None]], cos: torch.Tensor, sin: torch.Tensor
    ) -> list[torch.Tensor]:
        """`rotate` of each (x, out) pair (up to four tensors at the same positions, one dtype), in one
        launch on CUDA: a DSA layer's latent and query rope dims and its indexer's key and query."""
        xs, outs = tuple(x for x, _ in pairs), tuple(out for _, out in pairs)
        return rope(RopeArgs(xs, cos, sin, self.dim, self.is_interleaved, outs))

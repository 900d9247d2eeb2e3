"""INT4 W4A16 weights in the compressed-tensors `pack-quantized` layout (what Kimi K2 Thinking ships).

Symmetric, one BF16 scale per `group_size` consecutive inputs of an output row. The integer grid
and rounding are compressed-tensors' own (its min-max observer with a symmetric 4-bit range):
`scale = absmax / 7.5`, `q = clamp(round_half_even(w / scale), -8, 7)`, so a checkpoint Kumo writes
is the one llm-compressor would write from the same weights. Storage: `q + 8` as little-endian
nibbles along the input dim, element `k` of a row in int32 word `k // 8`, bits `4 * (k % 8)`.

Shape letters: N = out features, K = in features, G = ceil(K / group_size) groups, W = ceil(K / 8).
A partial last group (K not a multiple of the group size) is allowed here; compressed-tensors itself
requires K % group_size == 0, which every real checkpoint satisfies.
"""

from __future__ import annotations

import math

import torch

NIBBLES_PER_WORD = 8
Q_MIN, Q_MAX = -8, 7
# compressed-tensors' symmetric scale: absmax over half the integer range (15 / 2)
HALF_RANGE = (Q_MAX - Q_MIN) / 2
_SHIFTS = torch.arange(NIBBLES_PER_WORD, dtype=torch.int64) * 4


def num_groups(in_features: int, group_size: int) -> int:
    return math.ceil(in_features / group_size)


def _grouped(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """[N, K] -> [N, G, group_size], zero-padded at the end of each row."""
    n, k = w.shape
    g = num_groups(k, group_size)
    return torch.nn.functional.pad(w, (0, g * group_size - k)).view(n, g, group_size)


def int4_scales(w: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """BF16 scales [N, G] for `w` [N, K]; an all-zero group gets BF16's epsilon (no division by 0)."""
    absmax = _grouped(w.float(), group_size).abs().amax(dim=-1)  # [N, G]
    scale = (absmax / HALF_RANGE).to(torch.bfloat16)
    return torch.where(scale == 0, torch.finfo(torch.bfloat16).eps, scale)


def quantize_to_int(w: torch.Tensor, scale: torch.Tensor, group_size: int = 32) -> torch.Tensor:
    """Integer grid values q [N, K] int8 in [-8, 7] of `w` [N, K] under BF16 `scale` [N, G]."""
    n, k = w.shape
    # divide in the weight's own dtype (promoted with BF16), exactly as compressed-tensors does, so
    # ties round the same way and the packed words agree bit for bit
    wg = _grouped(w, group_size)  # [N, G, g]
    q = torch.round(wg / scale.unsqueeze(-1)).clamp(Q_MIN, Q_MAX)
    return q.view(n, -1)[:, :k].to(torch.int8)


def pack(q: torch.Tensor) -> torch.Tensor:
    """int8 q [N, K] in [-8, 7] -> int32 [N, W]: q + 8 as little-endian nibbles along K."""
    n, k = q.shape
    w = math.ceil(k / NIBBLES_PER_WORD)
    u = q.to(torch.int64) + 8  # [N, K] in [0, 15]
    # padding nibbles hold 0, exactly as compressed-tensors pads before packing
    u = torch.nn.functional.pad(u, (0, w * NIBBLES_PER_WORD - k)).view(n, w, NIBBLES_PER_WORD)
    words = (u << _SHIFTS.to(q.device)).sum(dim=-1)  # [N, W] in [0, 2^32)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack(packed: torch.Tensor, in_features: int) -> torch.Tensor:
    """int32 [N, W] -> int8 q [N, K] in [-8, 7] (the inverse of `pack`)."""
    n = packed.shape[0]
    nibbles = (packed.to(torch.int64).unsqueeze(-1) >> _SHIFTS.to(packed.device)) & 0xF  # [N, W, 8]
    return (nibbles.view(n, -1)[:, :in_features] - 8).to(torch.int8)


def quantize_int4(w: torch.Tensor, group_size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """`w` [N, K] float -> (weight_packed int32 [N, W], weight_scale bf16 [N, G]).

    Rows go through in blocks of about `CHUNK_ELEMENTS` weights, so the float and int64
    temporaries stay a few MiB whatever the tensor's size (`kumo quantize` holds about one shard).
    """
    if w.ndim != 2:
        raise ValueError(f"quantize_int4 takes a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    packed = torch.empty(n, math.ceil(k / NIBBLES_PER_WORD), dtype=torch.int32, device=w.device)
    scale = torch.empty(n, num_groups(k, group_size), dtype=torch.bfloat16, device=w.device)
    for r in range(0, n, rows_per_chunk(k)):
        rows = w[r : r + rows_per_chunk(k)]
        scale[r : r + rows.shape[0]] = s = int4_scales(rows, group_size)
        packed[r : r + rows.shape[0]] = pack(quantize_to_int(rows, s, group_size))
    return packed, scale


CHUNK_ELEMENTS = 1 << 20


def rows_per_chunk(row_length: int, multiple: int = 1) -> int:
    """Rows of `row_length` that make about CHUNK_ELEMENTS, a multiple of `multiple` (>= it)."""
    rows = max(1, CHUNK_ELEMENTS // max(row_length, 1))
    return max(multiple, rows // multiple * multiple)


def dequantize_int4(
    packed: torch.Tensor,
    scale: torch.Tensor,
    in_features: int,
    group_size: int = 32,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """(weight_packed [N, W], weight_scale [N, G]) -> w [N, K] of `dtype`.

    q * scale is exact in float32 (a 4-bit integer times an 8-bit mantissa), so casting once to
    BF16 gives the very bits compressed-tensors' BF16 multiply produces.
    """
    q = unpack(packed, in_features).float()  # [N, K]
    s = scale.float().repeat_interleave(group_size, dim=1)[:, :in_features]  # [N, K]
    return (q * s).to(dtype)

"""The INT4 format: compressed-tensors `pack-quantized` weights (what Kimi K2 Thinking ships), the one
implementation of quantize, pack, unpack and dequantize that `backend/quant` and the kernels share.

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


def unpack(packed: torch.Tensor, in_features: int | None = None) -> torch.Tensor:
    """int32 [N, W] -> int8 q [N, K] in [-8, 7] (the inverse of `pack`); K defaults to 8 W."""
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


def check_int4_operands(x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor, group_size: int) -> None:
    """The GEMM launchers' checks: x [..., K] fp16/bf16/fp32, w [N, K/8] int32, scales [N, K/G]."""
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"activations must be fp16, bf16 or fp32, got {x.dtype}")
    if w.dtype != torch.int32 or w.dim() != 2:
        raise TypeError(f"w_repacked must be 2-D int32 [N, K/8], got {w.dtype} {tuple(w.shape)}")
    if not scales.is_floating_point() or scales.dim() != 2:
        raise TypeError("scales must be a 2-D float tensor [N, K/G]")
    K, N = x.shape[-1], w.shape[0]
    if w.shape[1] * 8 != K or K % group_size:
        raise ValueError(f"K={K} does not match w_repacked {tuple(w.shape)} and group {group_size}")
    if tuple(scales.shape) != (N, K // group_size):
        raise ValueError(f"scales {tuple(scales.shape)} != ({N}, {K // group_size})")
    if not (x.device == w.device == scales.device):
        raise ValueError("x, w_repacked and scales must be on one device")


def repack_int4(
    weight_packed: torch.Tensor,  # [N, K/8] int32, checkpoint layout
    weight_scale: torch.Tensor,  # [N, K/G]
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Checkpoint tensors -> what the kernels take, once at load: `(w [N, K/8] int32, scales [N, K/G], G)`.

    The kernels read the checkpoint layout itself: K-contiguous words give each thread 16-byte loads
    and, unpacked, eight consecutive k, which is the K-major B operand the tensor cores want (a
    transposed `[K/8, N]` layout measured slower: 2-byte shared-memory stores of the dequantized
    tile). So the repack validates, infers the group size and makes both tensors contiguous.
    """
    if weight_packed.dtype != torch.int32 or weight_packed.dim() != 2:
        raise TypeError("weight_packed must be 2-D int32 [N, K/8]")
    N, K8 = weight_packed.shape
    if weight_scale.dim() != 2 or weight_scale.shape[0] != N or (8 * K8) % weight_scale.shape[1]:
        raise ValueError(f"weight_scale {tuple(weight_scale.shape)} does not fit weight_packed {(N, K8)}")
    group_size = 8 * K8 // weight_scale.shape[1]
    return weight_packed.contiguous(), weight_scale.contiguous(), group_size

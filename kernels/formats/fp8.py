"""The FP8 format: e4m3 weights with per-output-channel scales or DeepSeek/Kimi-style 128×128 block
scales, the one implementation `backend/quant` and the kernels share.

Both store `weight` as float8_e4m3fn and a float32 multiplier: dequantized = weight * scale.
- per channel (compressed-tensors `float-quantized`, strategy channel): `weight_scale` [N, 1].
- per block (DeepSeek-V3's own format, `quant_method: fp8`, `weight_block_size: [128, 128]`):
  `weight_scale_inv` [ceil(N/128), ceil(K/128)]. Despite the name it is the multiplier, as in
  DeepSeek's `weight_dequant`; edge blocks of shapes not divisible by 128 are partial.

Shape letters: N = out features, K = in features, Bn/Bk = blocks along N/K.
"""

from __future__ import annotations

import math

import torch

from kernels.formats.int4 import rows_per_chunk

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448.0
BLOCK = (128, 128)
_TINY = torch.finfo(torch.float32).tiny


def to_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale saturated to ±448 and rounded to e4m3 (the cast alone would give NaN past 448)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def from_fp8(
    q: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return (q.float() * scale).to(dtype)


def _scale_of(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448, divided on the CPU: CUDA divides by a Python scalar as a multiply by its
    reciprocal, one ulp off, and the same weights must give the same checkpoint on any device."""
    return (amax.cpu() / FP8_MAX).clamp_min(_TINY).to(amax.device)


def quantize_fp8_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight fp8 [N, K], weight_scale float32 [N, 1]); in row blocks (see int4)."""
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8, device=w.device)
    scale = torch.empty(n, 1, dtype=torch.float32, device=w.device)
    step = rows_per_chunk(k)
    for r in range(0, n, step):
        rows = w[r : r + step]
        scale[r : r + rows.shape[0]] = s = _scale_of(rows.float().abs().amax(dim=1, keepdim=True))  # [n, 1]
        q[r : r + rows.shape[0]] = to_fp8(rows, s)
    return q, scale


def dequantize_fp8_channel(
    q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    return from_fp8(q, scale.float().view(-1, 1), dtype)


def _blocks(w: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """[N, K] -> [Bn, bn, Bk, bk], zero-padded."""
    n, k = w.shape
    bn, bk = block
    nb, kb = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.nn.functional.pad(w, (0, kb * bk - k, 0, nb * bn - n))
    return padded.view(nb, bn, kb, bk)


def _expand(scale: torch.Tensor, shape: tuple[int, int], block: tuple[int, int]) -> torch.Tensor:
    """[Bn, Bk] -> [N, K]: each block's scale repeated over its (possibly partial) block."""
    n, k = shape
    return scale.repeat_interleave(block[0], dim=0)[:n].repeat_interleave(block[1], dim=1)[:, :k]


def quantize_fp8_block(w: torch.Tensor, block: tuple[int, int] = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (weight fp8 [N, K], weight_scale_inv float32 [Bn, Bk])."""
    if w.ndim != 2:
        raise ValueError(f"quantize_fp8_block takes a 2-D weight, got shape {tuple(w.shape)}")
    n, k = w.shape
    q = torch.empty(n, k, dtype=FP8, device=w.device)
    scale_inv = torch.empty(
        math.ceil(n / block[0]), math.ceil(k / block[1]), dtype=torch.float32, device=w.device
    )
    step = rows_per_chunk(k, block[0])  # whole row blocks at a time, in row blocks (see int4)
    for r in range(0, n, step):
        rows = w[r : r + step]
        b0 = r // block[0]
        s = _scale_of(_blocks(rows.float(), block).abs().amax(dim=(1, 3)))  # [bn, Bk]
        scale_inv[b0 : b0 + s.shape[0]] = s
        q[r : r + rows.shape[0]] = to_fp8(rows, _expand(s, tuple(rows.shape), block))
    return q, scale_inv


def dequantize_fp8_block(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int] = BLOCK,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    return from_fp8(q, _expand(scale_inv.float(), tuple(q.shape), block), dtype)


def dequantize_fp8(
    q: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] | None,
    dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """[N, K] e4m3 with per-channel [N, 1] (`block` None) or block [Bn, Bk] scales -> [N, K] `dtype`."""
    if block is None:
        return dequantize_fp8_channel(q, scale, dtype)
    return dequantize_fp8_block(q, scale, block, dtype)

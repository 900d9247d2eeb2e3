"""FP8 e4m3 weights: per-channel and 128x128 block scales, checked against compressed-tensors."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize

from kernels.formats.fp8 import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_channel,
    quantize_fp8_block,
    quantize_fp8_channel,
)

# e4m3 has 3 mantissa bits: round-to-nearest error is at most 2^-4 relative
E4M3_REL = 2.0**-4


@pytest.mark.parametrize("shape", [(300, 200), (128, 128), (1, 5), (129, 257)])
def test_block_scales_on_shapes_not_divisible_by_128(shape: tuple[int, int]) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    w[0, 0] = 40.0  # one outlier only coarsens its own block
    q, s = quantize_fp8_block(w)
    assert q.dtype == FP8 and q.shape == shape
    assert s.dtype == torch.float32 and s.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    args = QuantizationArgs(
        num_bits=8, type="float", symmetric=True, strategy="block", block_structure=[128, 128]
    )
    ref = ct_dequantize(q, s, None, args, dtype=torch.float32)
    ours = dequantize_fp8_block(q, s, dtype=torch.float32)
    assert torch.equal(ours, ref)
    err = (ours - w.float()).abs()
    per_elem_bound = (
        w.float().abs() * E4M3_REL
        + s.repeat_interleave(128, 0)[: shape[0]].repeat_interleave(128, 1)[:, : shape[1]] * 2.0**-9
    )
    assert bool((err <= per_elem_bound).all())
    if shape[0] > 128 and shape[1] > 128:
        assert float(s[1, 1]) < float(s[0, 0]) / 5


def test_channel_scales() -> None:
    w = torch.randn(33, 70, generator=torch.Generator().manual_seed(1))
    w[5] *= 100
    q, s = quantize_fp8_channel(w)
    assert s.shape == (33, 1)
    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy="channel")
    ref = ct_dequantize(q, s, None, args, dtype=torch.float32)
    ours = dequantize_fp8_channel(q, s, dtype=torch.float32)
    assert torch.equal(ours, ref)
    rel = ((ours - w).abs() / w.abs().amax(1, keepdim=True)).amax()
    assert float(rel) < E4M3_REL
    # each row's absmax maps to the top of the e4m3 range
    assert torch.allclose(q.float().abs().amax(1), torch.full((33,), 448.0))


def test_saturates_instead_of_nan() -> None:
    q, s = quantize_fp8_channel(torch.tensor([[1.0, -2.0]]))
    assert not bool(torch.isnan(q.float()).any())
    q2 = (torch.tensor([[1000.0]]) / 1.0).clamp(-448, 448).to(FP8)
    assert float(q2) == 448.0


def test_row_blocks_give_the_same_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The quantizers work in row blocks to bound memory; the blocks must not change a bit."""
    from kernels.formats import int4
    from kernels.formats.int4 import quantize_int4

    w = torch.randn(300, 200, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    whole = [quantize_int4(w, 32), quantize_fp8_channel(w), quantize_fp8_block(w)]
    monkeypatch.setattr(int4, "CHUNK_ELEMENTS", 1000)  # 5 rows at a time; 128-row blocks for fp8-block
    chunked = [quantize_int4(w, 32), quantize_fp8_channel(w), quantize_fp8_block(w)]
    for a, b in zip(whole, chunked, strict=True):
        for x, y in zip(a, b, strict=True):
            assert torch.equal(
                x.view(torch.uint8) if x.dtype == FP8 else x, y.view(torch.uint8) if y.dtype == FP8 else y
            )

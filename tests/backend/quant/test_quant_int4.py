"""INT4 pack-quantized against compressed-tensors, the independent reference, both ways."""

from __future__ import annotations

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
from compressed_tensors.quantization.utils import calculate_qparams

from kernels.formats.int4 import dequantize_int4, int4_scales, pack, quantize_int4, unpack


def _scheme(group_size: int) -> QuantizationScheme:
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=group_size)
    return QuantizationScheme(targets=["Linear"], weights=args)


@pytest.mark.parametrize("shape", [(5, 37), (16, 64), (3, 8), (1, 1), (7, 129)])
def test_pack_matches_compressed_tensors_both_ways(shape: tuple[int, int]) -> None:
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, shape, generator=g, dtype=torch.int8)
    ours = pack(q)
    ref = pack_to_int32(q, 4)
    assert ours.dtype == torch.int32 and ours.shape == (shape[0], -(-shape[1] // 8))
    assert torch.equal(ours, ref)
    assert torch.equal(unpack(ref, shape[1]), q)
    assert torch.equal(unpack_from_int32(ours, 4, torch.Size(shape)), q)


def test_nibble_order_is_little_endian_along_in() -> None:
    q = torch.tensor([[-8, -7, 0, 7, 0, 0, 0, 0, 1]], dtype=torch.int8)
    words = pack(q)
    # element k sits in bits 4*(k%8) of word k//8, stored as q+8
    assert int(words[0, 0]) & 0xFFFF == 0xF810
    assert (int(words[0, 0]) >> 16) & 0xFFFF == 0x8888
    assert int(words[0, 1]) == 9


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("shape", [(11, 256), (64, 384), (1, 128)])
def test_kumo_checkpoint_decompresses_with_compressed_tensors(
    group_size: int, shape: tuple[int, int]
) -> None:
    w = torch.randn(shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    packed, scale = quantize_int4(w, group_size)
    assert scale.dtype == torch.bfloat16 and scale.shape == (shape[0], shape[1] // group_size)
    state = {"weight_packed": packed, "weight_scale": scale, "weight_shape": torch.tensor(shape)}
    ref = PackedQuantizationCompressor.decompress(state, _scheme(group_size))["weight"]
    ours = dequantize_int4(packed, scale, shape[1], group_size)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("group_size", [32, 128])
def test_quantize_matches_compressed_tensors_minmax(group_size: int) -> None:
    """Same scales and same packed words as compressed-tensors' min-max observer would produce."""
    w = torch.randn(24, 256, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    groups = w.view(24, -1, group_size)
    args = _scheme(group_size).weights
    ref_scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    ours_packed, ours_scale = quantize_int4(w, group_size)
    assert torch.equal(ours_scale, ref_scale.to(torch.bfloat16))
    q_ref = ct_quantize(w, ours_scale, torch.zeros_like(ours_scale), args, dtype=torch.int8)
    assert torch.equal(ours_packed, pack_to_int32(q_ref, 4))
    compressed = PackedQuantizationCompressor.compress(
        {"weight": w, "weight_scale": ours_scale}, _scheme(group_size)
    )
    assert torch.equal(compressed["weight_packed"], ours_packed)


@pytest.mark.parametrize("group_size", [32, 128])
@pytest.mark.parametrize("shape", [(9, 100), (4, 31), (32, 256)])
def test_round_trip_error_within_half_a_step(group_size: int, shape: tuple[int, int]) -> None:
    """Error <= half a step, except where +7.5 steps (BF16-rounded scale) clamps to 7: there it is
    absmax - 7 steps, which the BF16 scale keeps under 0.53 of a step."""
    w = torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.05
    packed, scale = quantize_int4(w, group_size)
    dq = dequantize_int4(packed, scale, shape[1], group_size, dtype=torch.float32)
    step = scale.float().repeat_interleave(group_size, 1)[:, : shape[1]]
    err = (w - dq).abs()
    padded = torch.nn.functional.pad(w.abs(), (0, -shape[1] % group_size)).view(shape[0], -1, group_size)
    absmax = padded.amax(-1).repeat_interleave(group_size, 1)[:, : shape[1]]
    bound = torch.maximum(step * 0.5, absmax - 7 * step)
    assert bool((err <= bound + 1e-7).all())
    assert bool((bound <= step * 0.53).all())
    assert float(err.max()) > 0


def test_zero_and_constant_groups() -> None:
    w = torch.zeros(2, 64)
    w[1, 32:] = -3.0
    packed, scale = quantize_int4(w)
    dq = dequantize_int4(packed, scale, 64, dtype=torch.float32)
    assert torch.equal(dq[0], torch.zeros(64))
    # -3 is 7.49 steps of 3/7.5: it lands on -7 steps, half a step short, as compressed-tensors does
    assert torch.allclose(dq[1, 32:], torch.full((32,), -7 * float(scale[1, 1])))
    assert float((dq[1, 32:] + 3).abs().max()) <= float(scale[1, 1]) / 2
    assert bool((int4_scales(w) > 0).all())

"""The INT4 prefill switch: `EngineConfig.int4_prefill`, `kumo eval`'s `:int4-prefill=` option, and
`Int4Linear`'s dispatch to the FP8 kernels (run here in the Triton interpreter by standing in for the
CUDA check; the real CUDA run is `tests/kernels/test_w4a8_gemm.py::test_int4_linear_prefill_paths_gpu`)."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from backend.engine.engine_config import EngineConfig
from backend.quant.linear import Int4Linear, set_int4_prefill
from backend.tools.eval import parse_variant

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def _layer(gen: torch.Generator, n: int = 32, k: int = 128) -> Int4Linear:
    w = torch.randn(n, k, generator=gen) * 0.05
    return Int4Linear.from_weight(w, torch.randn(n, generator=gen), group_size=32)


def test_engine_config_and_variant_option() -> None:
    assert EngineConfig.build().int4_prefill == "w4a16"
    assert EngineConfig.build(int4_prefill="w4a8").int4_prefill == "w4a8"
    with pytest.raises(msgspec.ValidationError, match="int4_prefill"):
        EngineConfig.build(int4_prefill="w4a4")
    path, opts = parse_variant("ckpt:weights=int4-g32:all-linear:int4-prefill=expand-fp8")
    assert path == "ckpt" and opts.int4_prefill == "expand-fp8" and opts.all_linear
    assert parse_variant("ckpt")[1].int4_prefill == "w4a16"
    with pytest.raises(ValueError, match="int4-prefill=w4a16|w4a8|expand-fp8"):
        parse_variant("ckpt:int4-prefill=fp4")


def test_set_int4_prefill_counts_and_cpu_stays_reference() -> None:
    gen = torch.Generator().manual_seed(0)
    model = nn.Sequential(_layer(gen, 64, 128), nn.ReLU(), _layer(gen, 32, 64))
    x = torch.randn(5, 128, generator=gen)
    before = model(x)
    assert set_int4_prefill(model, "w4a8", min_tokens=1) == 2
    assert all(m.prefill == "w4a8" and m.prefill_min_tokens == 1 for m in model if isinstance(m, Int4Linear))
    assert torch.equal(model(x), before)  # the CPU always runs the dense reference
    assert set_int4_prefill(object(), "w4a8") == 0


@pytest.mark.parametrize("mode", ["w4a8", "expand-fp8"])
def test_dispatch_runs_the_fp8_product(mode: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the CUDA check stood in for, the forward is the FP8 kernel's product plus the bias: within
    the FP8 bound of the dense W4A16 result (kernels/test_w4a8_gemm.py derives it), and not equal."""
    from kernels.w4a8_expand import w4a8_expand_gemm
    from kernels.w4a8_gemm import w4a8_gemm

    gen = torch.Generator().manual_seed(1)
    layer = _layer(gen)
    x = torch.randn(7, 128, generator=gen)
    dense = layer(x)
    set_int4_prefill(layer, mode)  # type: ignore[arg-type]
    monkeypatch.setattr(Int4Linear, "_runs_fp8_prefill", lambda self, x, N: True)
    y = layer(x)
    fp8 = (w4a8_gemm if mode == "w4a8" else w4a8_expand_gemm)(x, layer.weight_packed, layer.weight_scale, 32)
    assert torch.equal(y, fp8 + layer.bias)
    err = float((y - dense).norm() / dense.norm())
    assert 0 < err < 2**-4 * 2**0.5

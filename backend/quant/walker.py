"""Putting quantized modules into a model, per a `QuantScheme`.

Two ways in:
- `build_for_checkpoint(make, scheme, device)` (the loader's): the model built on the meta device,
  every targeted Linear and routed-experts block replaced by an empty quantized module of the same
  geometry (this rank's ranges, `prepare_for_checkpoint`), then given storage on the device, ready
  for `load_weights` to fill from the shards; the dense weights are never allocated.
- `quantize_model(model, scheme)`: quantize the float weights a model already holds (for `kumo eval`
  variants and tests).
Either way `dequantize_after_load` then turns back to dense the few Linears the model reads as
matrices rather than calls (MLA's `kv_b_proj`).

Targeted modules are `backend.models.layers.linear.Linear` and `torch.nn.Linear` (class name `Linear`, as
compressed-tensors' `targets: ["Linear"]` means), and `backend.models.layers.moe.Experts`, which stands for
the per-expert Linears `experts.{e}.{gate,up,down}_proj` of the checkpoint and is judged by the
scheme on those names. The router (`mlp.gate`) and embeddings are other classes and never targeted.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from backend.errors import CheckpointError
from backend.models.layers.fused import FusedLinear
from backend.models.layers.linear import Linear
from backend.models.layers.moe import Experts
from backend.models.layers.rotary import Rotary
from backend.models.model_config import ModelConfig
from backend.quant.experts import QuantExperts
from backend.quant.linear import Fp8Linear, Int4Linear, QuantLinear
from backend.quant.scheme import READ_AS_MATRIX, QuantScheme, parse_config, scheme_from_config
from kernels.formats.fp8 import FP8, quantize_fp8_block, quantize_fp8_channel
from kernels.formats.int4 import quantize_int4


def read_scheme(path: str | Path) -> QuantScheme | None:
    """The scheme of a checkpoint folder's config.json (top level, or K2.5's `text_config`), if any."""
    raw = json.loads((Path(path) / "config.json").read_text())
    block = raw.get("quantization_config") or raw.get("text_config", {}).get("quantization_config")
    return scheme_from_config(parse_config(block)) if block else None


def _empty_linear(scheme: QuantScheme, m: Linear | nn.Linear) -> QuantLinear:
    if isinstance(m, nn.Linear):
        geometry = dict(bias=m.bias is not None, bias_dtype=m.weight.dtype)
    else:
        geometry = dict(
            bias=m.bias is not None,
            out_range=m.out_range,
            in_range=m.in_range,
            shard=m.shard,
            bias_dtype=m.weight.dtype,
        )
    if scheme.method == "int4":
        return Int4Linear(m.in_features, m.out_features, group_size=scheme.group_size, **geometry)  # type: ignore[arg-type]
    block = scheme.block if scheme.method == "fp8-block" else None
    return Fp8Linear(
        m.in_features,
        m.out_features,
        block=block,
        block_scale_name=scheme.block_scale_name,
        **geometry,  # type: ignore[arg-type]
    )


def _empty_experts(scheme: QuantScheme, m: Experts) -> QuantExperts:
    if m.is_width_split:
        raise CheckpointError("quantized routed experts are split by whole experts only: ep must equal tp")
    return QuantExperts(
        scheme, e0=m.e0, e1=m.e1, hidden=m.down_proj.shape[1], intermediate=m.intermediate, act=m.act,
        num_global_experts=m.num_global_experts,
    )  # fmt: skip


def _targets(model: nn.Module, scheme: QuantScheme) -> list[tuple[str, Linear | nn.Linear | Experts]]:
    found: list[tuple[str, Linear | nn.Linear | Experts]] = []
    for name, m in model.named_modules():
        if (
            isinstance(m, Linear | nn.Linear)
            and scheme.applies_to(name, "Linear")
            or isinstance(m, Experts)
            and scheme.applies_to(f"{name}.{m.e0}.gate_proj", "Linear")
        ):
            found.append((name, m))
    return found


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def build_for_checkpoint(
    make: Callable[[], nn.Module], scheme: QuantScheme, device: torch.device | str
) -> nn.Module:
    """The model, with quantized modules in place, without ever allocating the dense weights they
    replace: built on the meta device, swapped, then given storage on `device` (every persistent
    tensor is then filled by `load_weights`, which refuses a checkpoint that leaves one out).

    Non-persistent buffers are computed at construction, so the meta build cannot have them; the
    rotary tables are rebuilt from the config, and a model with any other such buffer is built
    densely on `device` instead (correct, only heavier).
    """
    with torch.device("meta"):
        model = make()
    persistent = set(model.state_dict())
    computed = [n for n, _ in model.named_buffers() if n not in persistent]
    if any(not n.startswith("rotary.") for n in computed) or not hasattr(model, "config"):
        with torch.device(device):
            model = make()
        prepare_for_checkpoint(model, scheme)
        return model
    prepare_for_checkpoint(model, scheme)
    model.to_empty(device=device)
    if computed:
        config = model.config
        assert isinstance(config, ModelConfig)  # a CausalLM's; nn.Module types it Tensor | Module
        with torch.device(device):
            model.rotary = Rotary(config.rope)
    return model


def prepare_for_checkpoint(model: nn.Module, scheme: QuantScheme) -> list[str]:
    """Swap targeted modules for empty quantized ones; return their names."""
    names = []
    for name, m in _targets(model, scheme):
        if isinstance(m, Experts):
            _replace(model, name, _empty_experts(scheme, m).to(m.down_proj.device))
        else:
            new = _empty_linear(scheme, m).to(m.weight.device)
            new.checkpoint_name = name
            _replace(model, name, new)
        names.append(name)
    return names


@torch.no_grad()
def dequantize_after_load(model: nn.Module) -> list[str]:
    """Replace loaded quantized Linears the model reads as matrices by dense ones; return names."""
    names = []
    for name, m in list(model.named_modules()):
        if isinstance(m, Int4Linear | Fp8Linear) and name.rpartition(".")[2] in READ_AS_MATRIX:
            dense = Linear(
                m.in_features,
                m.out_features,
                dtype=m.dense_dtype,
                bias=m.bias is not None,
                out_range=m.out_range,
                in_range=m.in_range,
                shard=m.shard,
            ).to(next(m.buffers()).device)
            dense.weight.copy_(m.dequantized_weight(m.dense_dtype))
            if m.bias is not None:
                dense.bias.copy_(m.bias)  # type: ignore[union-attr]
            _replace(model, name, dense)
            names.append(name)
    return names


@torch.no_grad()
def quantize_model(model: nn.Module, scheme: QuantScheme) -> list[str]:
    """Quantize the float weights a single-rank model holds, in place; return the swapped names.
    The model's Linears as the checkpoint names them: not yet fused (a stack of several would be
    quantized as one, its FP8 blocks straddling parts)."""
    if any(isinstance(m, FusedLinear) for m in model.modules()):
        raise ValueError("quantize_model takes an unfused model: load_model(..., fuse_projections=False)")
    names = []
    for name, m in _targets(model, scheme):
        new: QuantExperts | Int4Linear | Fp8Linear
        if isinstance(m, Experts):
            new = _empty_experts(scheme, m)
            I = m.intermediate
            for e in range(m.e1 - m.e0):
                for proj, w in (
                    ("gate_proj", m.gate_up_proj[e, :I]),
                    ("up_proj", m.gate_up_proj[e, I:]),
                    ("down_proj", m.down_proj[e]),
                ):
                    for tensor_name, t in quantize_tensor(scheme, w).items():
                        new.load_expert_part(m.e0 + e, proj, tensor_name, t)
        else:
            w, bias = m.weight, m.bias
            if scheme.method == "int4":
                new = Int4Linear.from_weight(w, bias, scheme.group_size)
            else:
                new = Fp8Linear.from_weight(w, bias, scheme.block if scheme.method == "fp8-block" else None)
            new.dense_dtype = w.dtype
        device = m.down_proj.device if isinstance(m, Experts) else m.weight.device
        _replace(model, name, new.to(device))
        names.append(name)
    dequantize_after_load(model)
    return names


def quantized_shapes(scheme: QuantScheme, n: int, k: int) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
    """The checkpoint tensors `quantize_tensor` makes of a [N, K] weight, in its order, uncomputed."""
    if scheme.method == "int4":
        g = scheme.group_size
        return [
            ("weight_packed", torch.int32, (n, math.ceil(k / 8))),
            ("weight_scale", torch.bfloat16, (n, math.ceil(k / g))),
            ("weight_shape", torch.int32, (2,)),
        ]
    if scheme.method == "fp8-channel":
        return [("weight", FP8, (n, k)), ("weight_scale", torch.float32, (n, 1))]
    b0, b1 = scheme.block
    return [
        ("weight", FP8, (n, k)),
        ("weight_scale_inv", torch.float32, (math.ceil(n / b0), math.ceil(k / b1))),
    ]


def quantize_tensor(scheme: QuantScheme, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """One float weight [N, K] -> the checkpoint tensors of its quantized form."""
    if scheme.method == "int4":
        packed, scale = quantize_int4(w, scheme.group_size)
        return {
            "weight_packed": packed,
            "weight_scale": scale,
            "weight_shape": torch.tensor(list(w.shape), dtype=torch.int32),
        }
    if scheme.method == "fp8-channel":
        q, s = quantize_fp8_channel(w)
        return {"weight": q, "weight_scale": s}
    q, s = quantize_fp8_block(w, scheme.block)
    return {"weight": q, "weight_scale_inv": s}

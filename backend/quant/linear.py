"""Quantized Linears and the walker that puts them into a model.

Each module holds exactly the tensors a checkpoint stores for it, under the checkpoint's names, so
`load_state_dict` fills it straight from the safetensors shards:
- `Int4Linear`: `weight_packed` int32 [N, ceil(K/8)], `weight_scale` bf16 [N, K/g], `weight_shape` [2].
- `Fp8Linear`: `weight` float8_e4m3fn [N, K] and either `weight_scale` [N, 1] (per channel) or
  `weight_scale_inv` [ceil(N/128), ceil(K/128)] (DeepSeek blocks).

On the CPU the forward dequantizes to the activation dtype and runs a dense matmul (the torch
reference); GPU kernels plug in behind the same modules later.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from backend.quant.fp8 import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_channel,
    quantize_fp8_block,
    quantize_fp8_channel,
)
from backend.quant.int4 import dequantize_int4, num_groups, quantize_int4
from backend.quant.scheme import QuantScheme


class Int4Linear(nn.Module):
    """W4A16: symmetric INT4 weights with one BF16 scale per `group_size` inputs."""

    def __init__(self, in_features: int, out_features: int, *, group_size: int = 32, bias: bool = False) -> None:
        super().__init__()
        self.in_features, self.out_features, self.group_size = in_features, out_features, group_size
        self.register_buffer("weight_packed", torch.zeros(out_features, math.ceil(in_features / 8), dtype=torch.int32))
        self.register_buffer(
            "weight_scale", torch.ones(out_features, num_groups(in_features, group_size), dtype=torch.bfloat16)
        )
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, group_size: int = 32) -> Int4Linear:
        mod = cls(linear.in_features, linear.out_features, group_size=group_size, bias=linear.bias is not None)
        packed, scale = quantize_int4(linear.weight.detach(), group_size)
        mod.weight_packed.copy_(packed)
        mod.weight_scale.copy_(scale)
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return mod

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_features, self.group_size, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, group_size={self.group_size}"


class Fp8Linear(nn.Module):
    """FP8 e4m3 weights with per-output-channel scales, or 2-D block scales when `block` is set."""

    def __init__(
        self, in_features: int, out_features: int, *, block: tuple[int, int] | None = None, bias: bool = False
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=FP8))
        if block is None:
            self.register_buffer("weight_scale", torch.ones(out_features, 1, dtype=torch.float32))
        else:
            shape = (math.ceil(out_features / block[0]), math.ceil(in_features / block[1]))
            self.register_buffer("weight_scale_inv", torch.ones(shape, dtype=torch.float32))
        self.bias = nn.Parameter(torch.zeros(out_features), requires_grad=False) if bias else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, block: tuple[int, int] | None = None) -> Fp8Linear:
        mod = cls(linear.in_features, linear.out_features, block=block, bias=linear.bias is not None)
        w = linear.weight.detach()
        if block is None:
            q, s = quantize_fp8_channel(w)
            mod.weight_scale.copy_(s)
        else:
            q, s = quantize_fp8_block(w, block)
            mod.weight_scale_inv.copy_(s)
        mod.weight.copy_(q)
        if linear.bias is not None:
            mod.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        return mod

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.block is None:
            return dequantize_fp8_channel(self.weight, self.weight_scale, dtype)
        return dequantize_fp8_block(self.weight, self.weight_scale_inv, self.block, dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}"


QuantLinear = Int4Linear | Fp8Linear


def empty_quant_linear(scheme: QuantScheme, in_features: int, out_features: int, bias: bool) -> QuantLinear:
    """A module ready to receive the checkpoint's tensors for one Linear."""
    if scheme.method == "int4":
        return Int4Linear(in_features, out_features, group_size=scheme.group_size, bias=bias)
    block = scheme.block if scheme.method == "fp8-block" else None
    return Fp8Linear(in_features, out_features, block=block, bias=bias)


def quantize_linear(scheme: QuantScheme, linear: nn.Linear) -> QuantLinear:
    """A quantized copy of a Linear that holds float weights."""
    if scheme.method == "int4":
        return Int4Linear.from_linear(linear, scheme.group_size)
    return Fp8Linear.from_linear(linear, scheme.block if scheme.method == "fp8-block" else None)


def swap_linears(model: nn.Module, scheme: QuantScheme, *, quantize_weights: bool) -> list[str]:
    """Replace every `nn.Linear` (or subclass) the scheme targets; return the swapped names.

    `quantize_weights=True` quantizes the float weights already in the model (eval, tests);
    False builds empty modules for a loader to fill from a quantized checkpoint.
    """
    swapped: list[str] = []
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or not scheme.applies_to(name, "Linear"):
            continue
        if quantize_weights:
            new = quantize_linear(scheme, module)
        else:
            new = empty_quant_linear(scheme, module.in_features, module.out_features, module.bias is not None)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)
        swapped.append(name)
    return swapped

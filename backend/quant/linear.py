"""Quantized Linears: `Int4Linear` (W4A16) and `Fp8Linear` (e4m3, per channel or 128×128 blocks).

Each holds exactly the tensors a checkpoint stores for one Linear, under the checkpoint's names, so
a state dict or the model's `load_param(name, full)` fills it straight from the safetensors shards:
- `Int4Linear`: `weight_packed` int32 [N, K/8], `weight_scale` bf16 [N, K/g], `weight_shape` int32 [2].
- `Fp8Linear`: `weight` float8_e4m3fn [N, K] and either `weight_scale` fp32 [N, 1] (per channel) or
  `weight_scale_inv` fp32 [N/128, K/128] (DeepSeek blocks; compressed-tensors' block strategy names
  the same tensor `weight_scale`, chosen by `block_scale_name`).

Like `backend.models.layers.linear.Linear`, a module keeps only this rank's rows (`out_range`) or columns
(`in_range`) and all-reduces when row-parallel. The product is the kernels' `int4_linear` /
`fp8_linear`: on CUDA the W4A16 and weight-only FP8 kernels read the quantized bytes once a call
(no dequantized weight is made at decode sizes); elsewhere the torch reference dequantizes to the
activation dtype and runs a dense matmul. An `Int4Linear` whose `prefill` is "w4a8" or "expand-fp8" runs products of
at least `prefill_min_tokens` tokens on CUDA on FP8 tensor cores instead (`kernels/w4a8_gemm.py`,
`kernels/w4a8_expand.py`; `set_int4_prefill` picks the path).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Self, TypedDict, Unpack

import torch
from torch import nn

from backend.engine.engine_config import Int4Prefill
from backend.errors import CheckpointError
from backend.models.layers.linear import Range, Shard, has_bias, stacked_bias
from kernels.formats.fp8 import (
    FP8,
    dequantize_fp8_block,
    dequantize_fp8_channel,
    quantize_fp8_block,
    quantize_fp8_channel,
)
from kernels.formats.int4 import dequantize_int4, quantize_int4
from kernels.fp8_linear import Fp8LinearArgs, fp8_linear
from kernels.int4_linear import Int4LinearArgs, int4_linear

# W4A8 / expand-fp8 run from this many tokens per product up (issue 6's prefill goal is M >= 2048);
# smaller products stay W4A16. Not yet measured on the H200: set it from bench_w4a8's crossover.
PREFILL_MIN_TOKENS = 1024


class Geometry(TypedDict, total=False):
    """`_QuantLinear`'s keyword arguments, which both quantized Linears pass through."""

    bias: bool
    out_range: Range | None
    in_range: Range | None
    shard: Shard | None
    bias_dtype: torch.dtype


def _bias_geometry(bias: torch.Tensor | None) -> Geometry:
    return Geometry(bias=bias is not None, bias_dtype=bias.dtype if bias is not None else torch.bfloat16)


class _QuantLinear(nn.Module):
    """Shared geometry: full `[out, in]` shape, this rank's ranges, bias, all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool = False,
        out_range: Range | None = None,
        in_range: Range | None = None,
        shard: Shard | None = None,
        bias_dtype: torch.dtype = torch.bfloat16,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.out_range = out_range or (0, out_features)
        self.in_range = in_range or (0, in_features)
        self.shard = shard or Shard()
        self.is_row_parallel = self.in_range != (0, in_features)
        self.out_local = self.out_range[1] - self.out_range[0]
        self.in_local = self.in_range[1] - self.in_range[0]
        self.bias = (
            nn.Parameter(torch.zeros(self.out_local, dtype=bias_dtype), requires_grad=False) if bias else None
        )
        self.dense_dtype = bias_dtype  # the dtype the unquantized layer had
        self.checkpoint_name = ""  # the module's name in the checkpoint, set by the walker; for errors

    def _where(self, name: str) -> str:
        return f"{self.checkpoint_name}.{name}" if self.checkpoint_name else name

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def product(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x [..., K] @ the weight's [N, K] transpose, without the bias, in `out_dtype(x)`; `rows`:
        only the first columns [..., rows], from a row-prefix view of the weight and its scales."""
        raise NotImplementedError

    def out_dtype(self, x: torch.Tensor) -> torch.dtype:
        """x's dtype, or the layer's wider one: a bf16 x into a float32 layer (the DSA indexer's
        `weights_proj`) is widened exactly, as `Linear` does."""
        return torch.promote_types(x.dtype, self.dense_dtype)

    if TYPE_CHECKING:  # nn.Module types every call `(...) -> Any`

        def __call__(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor: ...

    def forward(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        """x [..., K] → y [..., N]; `rows`: only y's first columns [..., rows], reading only those
        rows of the weight and their scales (a stack's leading parts: `FusedLinear`; no copy)."""
        y = self.product(x, rows)
        if self.bias is not None:
            y = y + (self.bias if rows is None else self.bias[:rows]).to(y.dtype)
        return self.shard.all_reduce(y) if self.is_row_parallel else y

    # ---- stacking (backend/models/layers/fused.py): Linears reading the same input as one product
    @property
    def row_block(self) -> int:
        """A part's rows must be a multiple of this for another part to follow it in a stack."""
        return 1

    def stack_key(self) -> Hashable | None:
        """Layers with equal keys stack into one (`stacked`); None: never (row-parallel)."""
        if self.is_row_parallel:
            return None
        return (type(self), self.in_local, self.dense_dtype, self._format(), next(self.buffers()).device)

    def _format(self) -> Hashable:
        raise NotImplementedError

    @classmethod
    def _empty_stack(cls, parts: Sequence[Self], **fmt: object) -> Self:
        """An empty (meta) layer of the parts' format whose rows are theirs stacked; its bias filled."""
        first = parts[0]
        rows = [p.out_local for p in parts]
        geometry = Geometry(bias=has_bias(parts), bias_dtype=first.dense_dtype)
        with torch.device("meta"):
            out = cls(first.in_local, sum(rows), **fmt, **geometry)
        if out.bias is not None:
            out.bias = nn.Parameter(stacked_bias(parts, rows), requires_grad=False)
        out.checkpoint_name = "+".join(p.checkpoint_name for p in parts)
        return out

    def _rows(self, full: torch.Tensor, per: int = 1) -> torch.Tensor:
        o0, o1 = self.out_range
        return full[o0 // per : math.ceil(o1 / per)]

    def _cols(self, full: torch.Tensor, per: int, name: str) -> torch.Tensor:
        i0, i1 = self.in_range
        if i0 % per or (i1 % per and i1 != self.in_features):
            raise CheckpointError(
                f"{self._where(name)}: this rank's input columns {self.in_range} split a group of {per}"
            )
        return full[:, i0 // per : math.ceil(i1 / per)]

    def _load_common(self, name: str, full: torch.Tensor) -> bool:
        if name == "bias" and self.bias is not None:
            _copy(
                self.bias,
                self._rows(full) if self.in_range[0] == 0 else torch.zeros_like(self._rows(full)),
                self._where(name),
            )
            return True
        if name == "weight_shape":
            if [int(v) for v in full.tolist()] != [self.out_features, self.in_features]:
                raise CheckpointError(
                    f"{self._where(name)} {full.tolist()} != [{self.out_features}, {self.in_features}]"
                )
            return True
        return False

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, out_range={self.out_range}, in_range={self.in_range}"


class Int4Linear(_QuantLinear):
    """W4A16: symmetric INT4 weights with one BF16 scale per `group_size` inputs."""

    weight_packed: torch.Tensor  # buffers (registered in __init__), typed for the kernels' calls
    weight_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        group_size: int = 32,
        **geometry: Unpack[Geometry],
    ) -> None:
        super().__init__(in_features, out_features, **geometry)
        self.group_size = group_size
        self.prefill: Int4Prefill = "w4a16"
        self.prefill_min_tokens = PREFILL_MIN_TOKENS
        N, K = self.out_local, self.in_local
        self.register_buffer("weight_packed", torch.zeros(N, math.ceil(K / 8), dtype=torch.int32))
        self.register_buffer("weight_scale", torch.ones(N, math.ceil(K / group_size), dtype=torch.bfloat16))
        self.register_buffer("weight_shape", torch.tensor([out_features, in_features], dtype=torch.int32))

    @classmethod
    def from_weight(
        cls, w: torch.Tensor, bias: torch.Tensor | None = None, group_size: int = 32
    ) -> Int4Linear:
        mod = cls(w.shape[1], w.shape[0], group_size=group_size, **_bias_geometry(bias))
        packed, scale = quantize_int4(w.detach(), group_size)
        mod.weight_packed.copy_(packed)
        mod.weight_scale.copy_(scale)
        if bias is not None:
            mod.bias.copy_(bias.detach())  # type: ignore[union-attr]
        return mod

    def _format(self) -> Hashable:
        return self.group_size

    @classmethod
    def stacked(cls, parts: Sequence[Int4Linear]) -> Int4Linear:
        """One layer whose output is the parts' outputs side by side: rows and their group scales
        stacked (exact: a row's product reads only its own row and scales)."""
        first = parts[0]
        out = cls._empty_stack(parts, group_size=first.group_size)
        out.weight_packed = torch.cat([p.weight_packed for p in parts])
        out.weight_scale = torch.cat([p.weight_scale for p in parts])
        out.weight_shape = torch.tensor(
            [out.out_features, out.in_features], dtype=torch.int32, device=out.weight_packed.device
        )
        out.prefill, out.prefill_min_tokens = first.prefill, first.prefill_min_tokens
        return out

    def load_param(self, name: str, full: torch.Tensor) -> int:
        if name == "weight_packed":
            _copy(self.weight_packed, self._cols(self._rows(full), 8, name), self._where(name))
        elif name == "weight_scale":
            _copy(self.weight_scale, self._cols(self._rows(full), self.group_size, name), self._where(name))
        elif not self._load_common(name, full):
            raise CheckpointError(f"unexpected tensor {self._where(name)!r} for an INT4 linear layer")
        return 1

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(self.weight_packed, self.weight_scale, self.in_local, self.group_size, dtype)

    def product(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        dtype = self.out_dtype(x)
        packed, scale = self.weight_packed, self.weight_scale  # [N, K/8], [N, K/G]
        if rows is not None:  # a row's product reads only its own row and scales
            packed, scale = packed[:rows], scale[:rows]
        # a widened product (float32 out of a bf16 x) stays W4A16: the FP8 paths answer in x's dtype
        if self.prefill == "w4a16" or dtype != x.dtype or not self._runs_fp8_prefill(x, packed.shape[0]):
            args = Int4LinearArgs(x, packed, scale, self.in_local, self.group_size, dtype)
            return int4_linear(args)  # a widened x's decode GEMV reads x as it is: no cast launch
        # prefill on CUDA: FP8 tensor cores (triton is the gpu extra: imported only here)
        if self.prefill == "w4a8":
            from kernels.w4a8_gemm import w4a8_gemm

            return w4a8_gemm(x, packed, scale, self.group_size)
        from kernels.w4a8_expand import w4a8_expand_gemm

        return w4a8_expand_gemm(x, packed, scale, self.group_size)

    def _runs_fp8_prefill(self, x: torch.Tensor, N: int) -> bool:
        """CUDA, enough tokens, bf16/fp16 activations and a geometry the FP8 kernels take (whole
        groups of 32+ inputs, a power of two; `_scaled_mm` wants N and K multiples of 16)."""
        g, K = self.group_size, self.in_local
        return (
            x.is_cuda
            and x.dtype in (torch.bfloat16, torch.float16)
            and x.numel() >= self.prefill_min_tokens * K
            and g >= 32
            and g & (g - 1) == 0
            and K % g == 0
            and K % 16 == 0
            and N % 16 == 0
        )


def set_int4_prefill(model: object, mode: Int4Prefill, min_tokens: int = PREFILL_MIN_TOKENS) -> int:
    """Every `Int4Linear` of `model` runs products of `min_tokens`+ tokens through `mode`; returns
    how many layers that is (0: no INT4 Linears, e.g. INT4 routed experts only, or not a Module)."""
    modules = model.modules() if isinstance(model, nn.Module) else ()
    layers = [m for m in modules if isinstance(m, Int4Linear)]
    for m in layers:
        m.prefill, m.prefill_min_tokens = mode, min_tokens
    return len(layers)


class Fp8Linear(_QuantLinear):
    """FP8 e4m3 weights with per-output-channel scales, or 2-D block scales when `block` is set."""

    weight: torch.Tensor  # buffers (registered in __init__), typed for the kernels' calls
    weight_scale: torch.Tensor  # per-channel scales only; block scales are `block_scale`

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        block: tuple[int, int] | None = None,
        block_scale_name: str = "weight_scale_inv",
        **geometry: Unpack[Geometry],
    ) -> None:
        super().__init__(in_features, out_features, **geometry)
        self.block, self.block_scale_name = block, block_scale_name
        N, K = self.out_local, self.in_local
        self.register_buffer("weight", torch.zeros(N, K, dtype=FP8))
        if block is None:
            self.register_buffer("weight_scale", torch.ones(N, 1, dtype=torch.float32))
        else:
            if self.out_range[0] % block[0] or self.in_range[0] % block[1]:
                raise CheckpointError(
                    f"FP8 blocks {block} do not align with ranges {self.out_range}, {self.in_range}"
                )
            shape = (math.ceil(N / block[0]), math.ceil(K / block[1]))
            self.register_buffer(block_scale_name, torch.ones(shape, dtype=torch.float32))

    @classmethod
    def from_weight(
        cls, w: torch.Tensor, bias: torch.Tensor | None = None, block: tuple[int, int] | None = None
    ) -> Fp8Linear:
        mod = cls(w.shape[1], w.shape[0], block=block, **_bias_geometry(bias))
        if block is None:
            q, s = quantize_fp8_channel(w.detach())
            mod.weight_scale.copy_(s)
        else:
            q, s = quantize_fp8_block(w.detach(), block)
            mod.block_scale.copy_(s)
        mod.weight.copy_(q)
        if bias is not None:
            mod.bias.copy_(bias.detach())  # type: ignore[union-attr]
        return mod

    def _format(self) -> Hashable:
        return (self.block, self.block_scale_name)

    @property
    def row_block(self) -> int:
        return 1 if self.block is None else self.block[0]

    @classmethod
    def stacked(cls, parts: Sequence[Fp8Linear]) -> Fp8Linear:
        """One layer whose output is the parts' outputs side by side: rows and their scales stacked.
        Exact per channel; with blocks only when every part but the last fills whole blocks of rows
        (`row_block`: the caller orders them so), else one block would mix two parts' scales."""
        first = parts[0]
        if any(p.out_local % p.row_block for p in parts[:-1]):
            raise ValueError("FP8 block rows: only the last stacked part may end inside a block")
        out = cls._empty_stack(parts, block=first.block, block_scale_name=first.block_scale_name)
        out.weight = torch.cat([p.weight for p in parts])
        if first.block is None:
            out.weight_scale = torch.cat([p.weight_scale for p in parts])
        else:
            setattr(out, first.block_scale_name, torch.cat([p.block_scale for p in parts]))
        return out

    def load_param(self, name: str, full: torch.Tensor) -> int:
        if name == "weight":
            if full.dtype != FP8:
                raise CheckpointError(f"{self._where(name)} of an FP8 layer is {full.dtype}, expected {FP8}")
            _copy(self.weight, self._cols(self._rows(full), 1, name), self._where(name))
        elif name == "weight_scale" and self.block is None:
            _copy(self.weight_scale, self._rows(full).reshape(-1, 1), self._where(name))
        elif name == self.block_scale_name and self.block is not None:
            _copy(
                self.block_scale,
                self._cols(self._rows(full, self.block[0]), self.block[1], name),
                self._where(name),
            )
        elif not self._load_common(name, full):
            raise CheckpointError(f"unexpected tensor {self._where(name)!r} for an FP8 linear layer")
        return 1

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        if self.block is None:
            return dequantize_fp8_channel(self.weight, self.weight_scale, dtype)
        return dequantize_fp8_block(self.weight, self.block_scale, self.block, dtype)

    def product(self, x: torch.Tensor, rows: int | None = None) -> torch.Tensor:
        weight, scale = self.weight, self.weight_scale if self.block is None else self.block_scale
        if rows is not None:  # per channel: the rows' scales; per block: whole blocks of rows only
            assert self.block is None or rows % self.block[0] == 0, (rows, self.block)
            weight, scale = weight[:rows], scale[: rows if self.block is None else rows // self.block[0]]
        return fp8_linear(Fp8LinearArgs(x.to(self.out_dtype(x)), weight, scale, self.block))

    @property
    def block_scale(self) -> torch.Tensor:
        """fp32 [Bn, Bk] block scales, under the checkpoint's name for them."""
        scale: torch.Tensor = getattr(self, self.block_scale_name)
        return scale


QuantLinear = Int4Linear | Fp8Linear


def _copy(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"{name}: checkpoint shape {tuple(src.shape)} != expected {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src.to(dst.dtype))

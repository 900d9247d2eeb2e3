"""`int4_linear`: a Linear with INT4 weights (compressed-tensors pack-quantized, one BF16 scale per
`group_size` inputs), activations unquantized (W4A16).

    y [..., N] = x [..., K] @ dequant(weight_packed [N, K/8], weight_scale [N, K/G]).T

y in x's dtype, or in float32 for a bf16 / fp16 x when `out_dtype` asks (the DSA indexer's float32
`weights_proj`): the decode GEMV widens x as it loads it, so the product costs no cast launch.

CUDA, whole groups (K a multiple of a power-of-two group of 8+): `kernels/w4a16_gemm.py`, which
picks by M (`kernels/w4a16_config.py`) its GEMV (1-2 rows, `kernels/w4a16_gemv.py`), tensor-core tiles (3-64) or, for
prefill, one Triton dequantizing pass and cuBLAS. Every other case: the reference, dequantize to the activation dtype then matmul.
(`backend.quant.linear.Int4Linear` may instead send prefill to FP8 tensor cores: `set_int4_prefill`.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.formats.int4 import dequantize_int4


@dataclass(frozen=True, slots=True)
class Int4LinearArgs:
    x: torch.Tensor  # [..., K] fp16 / bf16 / fp32
    weight_packed: torch.Tensor  # [N, ceil(K/8)] int32
    weight_scale: torch.Tensor  # [N, ceil(K/G)] bf16
    in_features: int  # K
    group_size: int  # G
    out_dtype: torch.dtype | None = None  # y's dtype: None, x's; float32 for a narrower x (widened exactly)


def int4_linear_ref(args: Int4LinearArgs) -> torch.Tensor:
    """Widen x to `out_dtype` if asked, dequantize to that dtype, then a dense matmul."""
    x = args.x.to(args.out_dtype or args.x.dtype)
    w = dequantize_int4(args.weight_packed, args.weight_scale, args.in_features, args.group_size, x.dtype)
    return F.linear(x, w)


def can_run_kernel(args: Int4LinearArgs) -> bool:
    """CUDA, a float activation, whole groups of a power-of-two size the W4A16 kernels take."""
    g, K = args.group_size, args.in_features
    return (
        args.x.is_cuda
        and args.x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and g % 8 == 0
        and g & (g - 1) == 0
        and K % g == 0
        and args.weight_packed.is_contiguous()
        and args.weight_scale.is_contiguous()
    )


def int4_linear(args: Int4LinearArgs) -> torch.Tensor:
    if can_run_kernel(args):  # CUDA (triton is the gpu extra: imported only here)
        from kernels.w4a16_gemm import w4a16_gemm

        return w4a16_gemm(
            args.x, args.weight_packed, args.weight_scale, args.group_size, out_dtype=args.out_dtype
        )
    return int4_linear_ref(args)

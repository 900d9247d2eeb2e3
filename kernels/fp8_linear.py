"""`fp8_linear`: a Linear with FP8 e4m3 weights (per channel or per block), activations unquantized.

    y [..., N] = x [..., K] @ dequant(w [N, K], scale).T

CUDA, up to `MAX_M` rows (a decode step's): the weight-only GEMV/GEMM of `kernels/fp8_gemm.py`,
which reads the FP8 bytes once and dequantizes in registers. Larger M on CUDA, and every other
device: the reference, dequantize to the activation dtype then matmul (the dequantization is
amortised over the rows there). `torch._scaled_mm` is not used: it quantizes the activations too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels.formats.fp8 import dequantize_fp8

# = kernels.fp8_gemm's MAX_M and GEMV_MAX_M (that module imports triton: only on the CUDA branch)
MAX_M, GEMV_MAX_M = 64, 2


@dataclass(frozen=True, slots=True)
class Fp8LinearArgs:
    x: torch.Tensor  # [..., K] fp16 / bf16 / fp32
    weight: torch.Tensor  # [N, K] float8_e4m3fn
    scale: torch.Tensor  # fp32 [N, 1] per channel, or [ceil(N/Sn), ceil(K/Sk)] per block
    block: tuple[int, int] | None  # (Sn, Sk), or None: per channel


def fp8_linear_ref(args: Fp8LinearArgs) -> torch.Tensor:
    """Dequantize to the activation dtype, then a dense matmul."""
    return F.linear(args.x, dequantize_fp8(args.weight, args.scale, args.block, args.x.dtype))


def can_run_kernel(args: Fp8LinearArgs) -> bool:
    """CUDA, decode-sized M, block scales the kernel's tiles divide; fp32 activations (the DSA
    indexer's weights_proj) only at the GEMV's rows (fp32 tiles spill: `tests/kernels/sm90_compile_fp8.py`)."""
    x, block = args.x, args.block
    max_m = (
        MAX_M if x.dtype in (torch.float16, torch.bfloat16) else GEMV_MAX_M if x.dtype == torch.float32 else 0
    )
    return (
        x.is_cuda
        and x.numel() <= max_m * x.shape[-1]
        and args.weight.is_contiguous()
        and (block is None or (block[0] % 64 == 0 and block[1] % 128 == 0))
    )


def fp8_linear(args: Fp8LinearArgs) -> torch.Tensor:
    if can_run_kernel(args):  # decode on CUDA (triton is the gpu extra: imported only here)
        from kernels.fp8_gemm import fp8_gemm

        return fp8_gemm(args.x, args.weight, args.scale, args.block)
    return fp8_linear_ref(args)

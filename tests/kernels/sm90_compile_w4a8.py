"""Compile the W4A8 prefill kernels for sm90 (H200) without a GPU: the GEMM's default tiles at group
32 and 128, the per-token FP8 quantizer and the INT4 -> FP8 expansion.

Like `tests/kernels/sm90_compile.py` (whose `compile_sm90` this reuses), but the integer arguments
a real launch sees divisible by 16 (row strides, K, K/8, K/G, N) are marked so: without that, the
e4m3 row loads are not known to be 16-byte aligned and Triton's pipeliner leaves them synchronous,
so registers and shared memory would not be what the H200 gets. Run without TRITON_INTERPRET:

    python -m tests.kernels.sm90_compile_w4a8
"""

from __future__ import annotations

import os
import sys
from typing import Any

from triton.compiler import ASTSource

from tests.kernels.sm90_compile import compile_sm90, launch_consts

DIV16 = ("N", "K", "K8", "KG", "stride_xm", "stride_qm", "stride_wn", "stride_sn", "stride_om")
UNIT = ("stride_xk", "stride_wk", "stride_sg", "stride_on")  # 1 at launch: Triton specialises them


def _source(
    fn: Any,
    ptrs: dict[str, str],
    consts: dict[str, Any],
    floats: set[str] = frozenset(),
    div16: tuple[str, ...] = DIV16,
    unit: tuple[str, ...] = UNIT,
) -> ASTSource:
    """`fn`'s signature with the `unit` strides as constants 1 and pointers and `div16` marked 16-divisible."""
    names = fn.arg_names
    consts = launch_consts(fn, {**consts, **{n: 1 for n in unit if n in names}})
    sig = {
        n: "constexpr"
        if n in consts
        else ("*" + ptrs[n] if n in ptrs else ("fp32" if n in floats else "i32"))
        for n in names
    }
    aligned = [n for n in names if n.endswith("_ptr") or n in div16]
    return ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )


def gemm_source(group: int, swap_xw: bool = True, **tiles: int) -> tuple[ASTSource, int, int]:
    from kernels.w4a8_gemm import W4A8Config, _w4a8_kernel

    cfg = W4A8Config(swap_xw=swap_xw, **tiles)
    consts = dict(
        GROUP_SIZE=group, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        CHUNK=min(group, cfg.block_k), GROUP_M=cfg.group_m, SWAP_XW=cfg.swap_xw,
    )  # fmt: skip
    ptrs = {"xq_ptr": "fp8e4nv", "xs_ptr": "fp32", "w_ptr": "i32", "s_ptr": "bf16", "out_ptr": "bf16"}
    return _source(_w4a8_kernel, ptrs, consts), cfg.num_warps, cfg.num_stages


def quant_source() -> ASTSource:
    from kernels.w4a8_gemm import _quant_rows_kernel

    return _source(
        _quant_rows_kernel, {"x_ptr": "bf16", "q_ptr": "fp8e4nv", "s_ptr": "fp32"}, {"BLOCK_K": 2048}
    )


def expand_source(group: int) -> ASTSource:
    from kernels.int4_dequant import _int4_dequant_kernel

    ptrs = {"w_ptr": "i32", "s_ptr": "bf16", "inv_ptr": "fp32", "out_ptr": "fp8e4nv"}
    consts = dict(GROUP_SIZE=group, BLOCK_N=32, BLOCK_K=256, SCALE_ROWS=max(256 // group, 1), ROW_SCALED=True)
    return _source(_int4_dequant_kernel, ptrs, consts)


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces what this compiles")
    for group in (32, 128):  # swap_xw=False spills at these tiles (255 registers): not a default
        src, warps, stages = gemm_source(group)
        print(f"{f'w4a8 gemm g{group} (default tiles)':<44} {compile_sm90(src, warps, stages)}")
    print(f"{'fp8 row quantizer bf16 -> e4m3':<44} {compile_sm90(quant_source(), 8)}")
    print(f"{'int4 -> fp8 expansion g32':<44} {compile_sm90(expand_source(32), 4)}")


if __name__ == "__main__":
    main()

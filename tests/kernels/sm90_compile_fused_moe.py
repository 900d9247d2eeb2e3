"""Compile the FP8 fused MoE kernels for sm90 (H200) without a GPU (`kernels/fused_moe_fp8.py`: the
decode GEMV and the tile kernel at `pick_fp8_moe_config`'s tiles, gate+up and down, per-channel and
128×128 block scales; the K split is the grid's, not compiled in); bf16 activations as the engine runs them. The
INT4 ones are in `tests/kernels/sm90_compile_int4.py`.

Like `tests/kernels/sm90_compile_w4a8.py`: the integer arguments a real launch sees divisible by 16
(K, N, row strides of activations, weights and outputs) are marked so, and the unit strides are
constants (Triton specializes 1), so the loads and registers are what the H200 gets. Run without
TRITON_INTERPRET:

    python -m tests.kernels.sm90_compile_fused_moe
"""

from __future__ import annotations

import os
import sys
from typing import Any

from triton.compiler import ASTSource

from kernels.fused_moe_fp8 import pick_fp8_moe_config
from tests.kernels.sm90_compile import compile_sm90
from tests.kernels.sm90_compile_w4a8 import _source as w4a8_source

DIV16 = ("N", "K", "K8", "KG", "stride_am", "stride_we", "stride_wn", "stride_se", "stride_sn", "stride_om")
UNIT = ("stride_ak", "stride_wk", "stride_sk", "stride_sg", "stride_on")
BLOCK = (128, 128)


def _source(fn: Any, ptrs: dict[str, str], consts: dict[str, Any]) -> ASTSource:
    return w4a8_source(fn, ptrs, consts, div16=DIV16, unit=UNIT)


def _scale_consts(block: bool) -> dict[str, int]:
    return {"SCALE_BN": BLOCK[0], "SCALE_BK": BLOCK[1]} if block else {"SCALE_BN": 1, "SCALE_BK": 0}


def gemv_source(gate_up: bool, block: bool) -> tuple[ASTSource, int, int]:
    from kernels.fused_moe_fp8 import _fused_moe_fp8_gemv_kernel as fn

    cfg = pick_fp8_moe_config(8, 384, BLOCK if block else None)  # one token, Kimi
    ptrs = {
        "a_ptr": "bf16", "w_ptr": "fp8e4nv", "s_ptr": "fp32", "s_up_ptr": "fp32", "out_ptr": "bf16",
        "ws_ptr": "fp32", "cnt_ptr": "i32", "topk_w_ptr": "fp32", "topk_ids_ptr": "i64", "add_ptr": "bf16",
    }  # fmt: skip
    consts = dict(
        A_ROW_DIV=8 if gate_up else 1, TOP_K=8, GATE_UP=gate_up, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, ADD=not gate_up, **_scale_consts(block),  # down: the shared experts' add
    )  # fmt: skip
    return _source(fn, ptrs, consts), cfg.num_warps, cfg.num_stages


def tiles_source(gate_up: bool, block: bool, num_pairs: int) -> tuple[ASTSource, int, int]:
    from kernels.fused_moe_fp8 import _fused_moe_fp8_kernel as fn

    cfg = pick_fp8_moe_config(num_pairs, 384, BLOCK if block else None)
    ptrs = {
        "a_ptr": "bf16", "w_ptr": "fp8e4nv", "s_ptr": "fp32", "s_up_ptr": "fp32", "out_ptr": "bf16",
        "topk_w_ptr": "fp32", "sorted_ids_ptr": "i32", "block_expert_ids_ptr": "i32", "num_padded_ptr": "i32",
    }  # fmt: skip
    consts = dict(
        A_ROW_DIV=8 if gate_up else 1, GATE_UP=gate_up, MUL_WEIGHT=not gate_up, BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, DOT_PRECISION="tf32", **_scale_consts(block),
    )  # fmt: skip
    return _source(fn, ptrs, consts), cfg.num_warps, cfg.num_stages


def main() -> None:
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces what this compiles")
    cases = [
        ("gemv gate_up channel", gemv_source(True, False)),
        ("gemv gate_up block", gemv_source(True, True)),
        ("gemv down block", gemv_source(False, True)),
        ("gemv down channel", gemv_source(False, False)),
        ("tiles BM16 gate_up block", tiles_source(True, True, 64 * 8)),
        ("tiles BM16 down channel", tiles_source(False, False, 64 * 8)),
        ("tiles BM64 gate_up channel", tiles_source(True, False, 4096 * 8)),
        ("tiles BM64 gate_up block", tiles_source(True, True, 4096 * 8)),
    ]
    cases = [("fp8 moe " + name, case) for name, case in cases]
    for name, (src, warps, stages) in cases:
        print(f"{name:<44} {compile_sm90(src, warps, stages)}", flush=True)


if __name__ == "__main__":
    main()

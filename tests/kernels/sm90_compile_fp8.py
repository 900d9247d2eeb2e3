"""Compile the weight-only FP8 GEMV and tiles (`kernels/fp8_gemm.py`) for sm90 without a GPU: the
launcher's default configs, per-channel and 128×128-block scales, bf16 activations (and fp32 in the
GEMV, the only kernel `kernels/fp8_linear.py` gives them); one line per kernel with ptxas's registers and spills.

    python -m tests.kernels.sm90_compile_fp8
"""

from __future__ import annotations

from typing import Any

from triton.compiler import ASTSource

from kernels.fp8_gemm import GEMV_DEFAULT, TILE_DEFAULTS, Fp8GemmConfig
from tests.kernels.sm90_compile import compile_args, compile_sm90, launch_consts

STRIDES = ("stride_xm", "stride_wn", "stride_om", "K")  # 16-byte multiples, as the launchers' tensors


def source(cfg: Fp8GemmConfig, x: str, block: bool) -> ASTSource:
    from kernels.fp8_gemm import _fp8_gemv_kernel, _fp8_tile_kernel

    fn: Any = _fp8_gemv_kernel if cfg.block_m == 0 else _fp8_tile_kernel
    ptrs = {"x_ptr": x, "w_ptr": "fp8e4nv", "s_ptr": "fp32", "out_ptr": x, "ws_ptr": "fp32", "cnt_ptr": "i32"}
    consts: dict[str, Any] = {"SCALE_BN": 128 if block else 1, "SCALE_BK": 128 if block else 0,
                              "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k}  # fmt: skip
    if cfg.block_m == 0:
        consts["EVEN_K"] = True
    else:
        consts |= {"BLOCK_M": cfg.block_m, "SPLIT_K": cfg.split_k,
                   "DOT_PRECISION": "ieee" if x == "fp32" else "tf32"}  # fmt: skip
    names = fn.arg_names
    consts = launch_consts(fn, consts)
    sig = {n: "constexpr" if n in consts else ("*" + ptrs[n] if n in ptrs else "i32") for n in names}
    ones = {"stride_xk", "stride_wk"}  # K-contiguous rows: specialised to 1 as at launch
    aligned = [(names.index(n),) for n in names if n.endswith("_ptr") or n in STRIDES]
    return ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()} | {(names.index(n),): 1 for n in ones},
        attrs={k: [["tt.divisibility", 16]] for k in aligned},
    )


def main() -> None:
    compile_args()
    configs = [("gemv", GEMV_DEFAULT)] + [(f"tiles<={bound}", cfg) for bound, cfg in TILE_DEFAULTS]
    for name, cfg in configs:
        for x in ("bf16", "fp32") if cfg.block_m == 0 else ("bf16",):  # fp32 tiles: never launched
            for block in (True, False):
                line = compile_sm90(source(cfg, x, block), cfg.num_warps, cfg.num_stages)
                print(f"{name} x={x} {'block' if block else 'channel'}: {line}")


if __name__ == "__main__":
    main()

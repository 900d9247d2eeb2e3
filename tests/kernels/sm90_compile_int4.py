"""Compile the INT4 kernels for sm90 (H200) without a GPU: the W4A16 GEMV and tiles
(`kernels/w4a16_gemm.py`), the fused MoE's GEMV and tiles (`kernels/fused_moe.py`) and the
token→expert alignment (`kernels/moe_align.py`), at the launchers' defaults for 8192² and Kimi K2's
experts, bf16 activations, group 32 and 128.

Prints ptxas's registers and spills and, for the GEMVs, their K loop's SASS per INT4 weight
(`loop_stats`: the goal is one LOP3 and one FFMA per nibble and no barrier in the loop; the old
kernels took 5.4). The arguments a real launch sees divisible by 16 are marked so and unit strides
are constants, as in `tests/kernels/sm90_compile_w4a8.py`. Run without TRITON_INTERPRET:

    python -m tests.kernels.sm90_compile_int4          # defaults (CI: no spills, no loop barrier)
    python -m tests.kernels.sm90_compile_int4 --all    # also the benchmark's GEMV candidates
"""

from __future__ import annotations

from typing import Any

from triton.compiler import ASTSource

from kernels.fused_moe import _fused_moe_gemv_kernel, _fused_moe_kernel
from kernels.moe_align import _moe_align_kernel, align_chunk
from kernels.moe_routing import GEMV_CONFIG, MoEConfig, pick_moe_config
from kernels.w4a16_config import GEMV_DEFAULT, GEMV_NARROW, W4A16Config, pick_config
from kernels.w4a16_gemm import _w4a16_kernel
from kernels.w4a16_gemv import _w4a16_gemv_kernel, _w4a16_gemv_tma_kernel
from tests.kernels.sm90_compile import compile_args, compile_sm90, launch_consts
from tests.kernels.sm90_compile_w4a8 import _source

GEMM_DIV16 = ("N", "K", "K8", "KG", "stride_xm", "stride_wn", "stride_sn", "stride_om")
GEMM_UNIT = ("stride_xk", "stride_wk", "stride_sg", "stride_on")
MOE_DIV16 = (
    "N",
    "K",
    "K8",
    "KG",
    "stride_am",
    "stride_we",
    "stride_wn",
    "stride_se",
    "stride_sn",
    "stride_om",
)
MOE_UNIT = ("stride_ak", "stride_wk", "stride_sg", "stride_on")


def gemm_case(cfg: W4A16Config, group: int) -> tuple[ASTSource, int, int, int]:
    """(source, warps, stages, nibbles per thread per K trip) of the W4A16 kernel `cfg` selects."""
    ptrs = {"w_ptr": "i32", "s_ptr": "bf16", "out_ptr": "bf16", "ws_ptr": "fp32", "cnt_ptr": "i32"}
    consts: dict[str, Any] = dict(GROUP_SIZE=group, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
    if cfg.block_m == 0 and cfg.tma_stages > 1:
        return (
            _tma_gemv_source(cfg, group, ptrs),
            cfg.num_warps,
            1,
            cfg.gemv_rows * cfg.block_n * cfg.block_k // (32 * cfg.num_warps),  # per nibble and row
        )
    if cfg.block_m == 0:
        consts.update(
            LIFTED=cfg.lift, EVEN_K=True, EVEN_N=True, LOOP_STAGES=cfg.loop_stages, PREFETCH=cfg.prefetch
        )
        src = _source(
            _w4a16_gemv_kernel,
            {"x_ptr": "fp32" if cfg.lift else "bf16", **ptrs},
            consts,
            div16=GEMM_DIV16,
            unit=GEMM_UNIT,
        )
        return src, cfg.num_warps, cfg.num_stages, cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
    consts.update(
        BLOCK_M=cfg.block_m,
        SPLIT_K=cfg.split_k,
        GROUP_M=cfg.group_m,
        SCALE_ROWS=max(cfg.block_k // group, 1),
        DOT_PRECISION="tf32",
        SWAP_XW=cfg.swap_xw,
    )
    src = _source(_w4a16_kernel, {"x_ptr": "bf16", **ptrs}, consts, div16=GEMM_DIV16, unit=GEMM_UNIT)
    return src, cfg.num_warps, cfg.num_stages, 0


def _tma_gemv_source(cfg: W4A16Config, group: int, ptrs: dict[str, str]) -> ASTSource:
    """The TMA GEMV: the weight comes as a TMA descriptor of [block_n, block_k / 8] int32 boxes."""
    fn = _w4a16_gemv_tma_kernel
    names = fn.arg_names
    consts: dict[str, Any] = launch_consts(fn, dict(
        GROUP_SIZE=group, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, EVEN_N=True,
        STAGES=cfg.tma_stages, ROWS=cfg.gemv_rows, **{n: 1 for n in GEMM_UNIT if n in names},
    ))  # fmt: skip
    sig = {
        n: "constexpr"
        if n in consts
        else (
            f"tensordesc<i32[{cfg.block_n},{cfg.block_k // 8}]>"
            if n == "w_desc"
            else ("*bf16" if n == "x_ptr" else ("*" + ptrs[n] if n in ptrs else "i32"))
        )
        for n in names
    }
    aligned = [n for n in names if n.endswith("_ptr") or n in GEMM_DIV16]
    return ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )


def moe_case(cfg: MoEConfig, gate_up: bool) -> tuple[ASTSource, int, int, int]:
    """(source, warps, stages, nibbles per thread per K trip) of the INT4 MoE kernel `cfg` selects."""
    lifted = cfg.lift or not gate_up
    if cfg.block_m == 0 or cfg.grouped:
        ptrs = {
            "a_ptr": "fp32" if lifted else "bf16", "w_ptr": "i32", "s_ptr": "bf16",
            "out_ptr": "fp32" if gate_up else "bf16", "ws_ptr": "fp32", "cnt_ptr": "i32", "topk_w_ptr": "fp32",
            "ids_ptr": "i32" if cfg.grouped else "i64", "block_expert_ids_ptr": "i32", "num_padded_ptr": "i32",
            "add_ptr": "bf16", "topk_ids_ptr": "i64",
        }  # fmt: skip
        consts: dict[str, Any] = dict(
            A_ROW_DIV=8 if gate_up else 1, TOP_K=8, GATE_UP=gate_up, LIFTED=lifted, GROUPED=cfg.grouped,
            GROUP_SIZE=32, BLOCK_M=max(cfg.block_m, 1), BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
            EVEN_K=True, EVEN_N=True, LOOP_STAGES=cfg.loop_stages, ADD=not gate_up,  # down: the shared experts' add
        )  # fmt: skip
        nibbles = (2 if gate_up else 1) * cfg.block_n * cfg.block_k // (32 * cfg.num_warps)
        src = _source(_fused_moe_gemv_kernel, ptrs, consts, div16=MOE_DIV16, unit=MOE_UNIT)
        return src, cfg.num_warps, cfg.num_stages, nibbles
    ptrs = {
        "a_ptr": "bf16", "w_ptr": "i32", "s_ptr": "bf16", "out_ptr": "bf16", "topk_w_ptr": "fp32",
        "sorted_ids_ptr": "i32", "block_expert_ids_ptr": "i32", "num_padded_ptr": "i32",
    }  # fmt: skip
    consts = dict(
        A_ROW_DIV=8 if gate_up else 1, GATE_UP=gate_up, MUL_WEIGHT=not gate_up, GROUP_SIZE=32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, SCALE_ROWS=cfg.block_k // 32,
        DOT_PRECISION="tf32",
    )  # fmt: skip
    return (
        _source(_fused_moe_kernel, ptrs, consts, div16=MOE_DIV16, unit=MOE_UNIT),
        cfg.num_warps,
        cfg.num_stages,
        0,
    )


def align_case(num_pairs: int) -> tuple[ASTSource, int, int, int]:
    """`moe_align`'s kernel for Kimi's 384 experts at `num_pairs`' chunk size."""
    ptrs = {"ids_ptr": "i64", "sorted_ids_ptr": "i32", "block_expert_ids_ptr": "i32", "num_padded_ptr": "i32"}
    consts = dict(NUM_BINS=512, BLOCK_P=align_chunk(num_pairs), BLOCK_B=32)
    return _source(_moe_align_kernel, ptrs, consts, div16=(), unit=()), 4, 2, 0


def default_cases() -> list[tuple[str, tuple[ASTSource, int, int, int]]]:
    cases = [("moe align P=8", align_case(8)), ("moe align P=4096", align_case(4096))]
    for group in (128, 32):
        for M in (1, 16, 64):
            cfg = pick_config(M, 8192, 8192, 132, group)
            cases.append(
                (f"w4a16 M={M} g{group} {'gemv' if cfg.block_m == 0 else 'tiles'}", gemm_case(cfg, group))
            )
    cases.append(("w4a16 M=1 g32 narrow gemv", gemm_case(GEMV_NARROW[0], 32)))
    cases.append(("w4a16 M=2 g32 gemv", gemm_case(pick_config(2, 8192, 8192, 132, 32), 32)))
    for tokens, experts in ((1, 384), (64, 384), (64, 128)):  # Kimi decode and M=64, GLM-4.5-Air M=64
        cfg = pick_moe_config(tokens * 8, experts)
        kind = "tiles" if cfg.block_m and not cfg.grouped else "gemv"
        for gate_up in (True, False):
            name = f"int4 moe M={tokens} E={experts} {kind} {'gate_up' if gate_up else 'down'}"
            cases.append((name, moe_case(cfg, gate_up)))
    return cases


def candidate_cases() -> list[tuple[str, tuple[ASTSource, int, int, int]]]:
    """The GEMV variants `bench_w4a16 --quick` and `bench_fused_moe --quick` time."""
    from benchmarks.kernels.bench_fused_moe import QUICK_GEMVS, QUICK_GROUPED
    from benchmarks.kernels.bench_w4a16 import QUICK_GEMVS as W4A16_GEMVS

    cases, seen = [], set()
    for cfg in W4A16_GEMVS:
        cases.append(
            (
                f"w4a16 gemv {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} lift={cfg.lift} s{cfg.loop_stages}"
                f" tma{cfg.tma_stages} prefetch={cfg.prefetch}",
                gemm_case(cfg, 32),
            )
        )
    for cfg in QUICK_GEMVS + QUICK_GROUPED:
        key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.lift, cfg.grouped, cfg.loop_stages)
        if key in seen:
            continue  # the same kernels at another split
        seen.add(key)
        for gate_up in (True, False):
            kind = f"grouped{cfg.block_m}" if cfg.grouped else "gemv"
            name = f"int4 moe {kind} {cfg.block_n}x{cfg.block_k} w{cfg.num_warps} lift={cfg.lift} s{cfg.loop_stages} {'gate_up' if gate_up else 'down'}"
            cases.append((name, moe_case(cfg, gate_up)))
    return cases


def main() -> None:
    args = compile_args()
    assert GEMV_DEFAULT.block_m == 0 and GEMV_CONFIG.block_m == 0
    for name, (src, warps, stages, nibbles) in default_cases() + (candidate_cases() if args.all else []):
        print(f"{name:<52} {compile_sm90(src, warps, stages, loop_nibbles=nibbles)}", flush=True)


if __name__ == "__main__":
    main()

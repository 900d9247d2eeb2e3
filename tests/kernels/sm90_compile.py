"""Compile the MLA, GQA prefill, DSA indexer and kv_write kernels for sm90 (H200) without a GPU.

CI has no GPU and runs kernels in the interpreter, which never lowers them; this catches what only a
real compile shows (types, layouts, shared memory) and prints ptxas's registers and spills per
config. Run in a process without TRITON_INTERPRET (the interpreter patches `tl`):

    python -m tests.kernels.sm90_compile            # the launchers' default tiles (CI)
    python -m tests.kernels.sm90_compile --all      # every config the benchmark sweeps
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_TL = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def mla_source(
    q: str = "bf16", cache: str = "bf16", block_q: int = 1, block_h: int = 16, block_n: int = 32,
    varlen: bool = False, sparse: bool = False, direct: bool = False, masked: bool = False, check: bool = True,
) -> ASTSource:  # fmt: skip
    from kernels.mla_decode import _mla_paged_kernel as fn

    ptrs = {
        "q_ptr": q, "cache_ptr": cache, "page_table_ptr": "i32", "expected_ptr": "i64", "page_tags_ptr": "i64",
        "seq_lens_ptr": "i32", "query_start_ptr": "i32", "tile_seq_ptr": "i32", "tile_q0_ptr": "i32",
        "topk_ptr": "i64", "mismatch_ptr": "u8", "part_o_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": q,
    }  # fmt: skip
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, BLOCK_Q=block_q, BLOCK_H=block_h, BLOCK_N=block_n, BLOCK_R=512, BLOCK_DR=64, BLOCK_P=128,
        VARLEN=varlen, SPARSE=sparse, CHECK_TAGS=check, MASKED_LOADS=masked, DIRECT=direct,
        COMPUTE=tl.float16 if cache == "fp8e4nv" else _TL[q], DOT_PRECISION="ieee" if q == "fp32" else "tf32",
    )  # fmt: skip
    return _source(fn, ptrs, consts, {"qk_scale", "v_scale"})


def kv_write_source(cache: str = "fp8e4nv", values: str = "bf16", check: bool = True) -> ASTSource:
    from kernels.kv_write_triton import _kv_write_kernel as fn

    ptrs = {
        "cache_ptr": cache, "values_ptr": values, "slot_ptr": "i64", "page_tags_ptr": "i64",
        "token_expected_ptr": "i64", "token_seq_ptr": "i64", "mismatch_ptr": "u8",
    }  # fmt: skip
    consts = dict(
        PAGE_SIZE=16,
        BLOCK_W=1024,
        QUANT=cache == "fp8e4nv",
        FMAX=448.0 if cache == "fp8e4nv" else 0.0,
        CHECK_TAGS=check,
    )
    return _source(fn, ptrs, consts, {"scale"})


def gqa_prefill_source(
    q: str = "bf16", cache: str = "bf16", block_m: int = 64, block_n: int = 64
) -> ASTSource:
    from kernels.paged_prefill_gqa import _paged_prefill_gqa_kernel as fn

    ptrs = {
        "q_ptr": q, "k_ptr": cache, "v_ptr": cache, "page_table_ptr": "i32", "expected_ptr": "i64",
        "page_tags_ptr": "i64", "seq_lens_ptr": "i32", "query_start_ptr": "i32", "tile_seq_ptr": "i32",
        "tile_q0_ptr": "i32", "mismatch_ptr": "u8", "part_o_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": q,
    }  # fmt: skip
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, GROUP=12, BLOCK_Q=block_m // 12, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_P=64,
        BLOCK_D=128, BLOCK_DV=128, CHECK_TAGS=True, DIRECT=True,
        COMPUTE=tl.float16 if cache == "fp8e4nv" else _TL[q], DOT_PRECISION="tf32",
    )  # fmt: skip
    return _source(fn, ptrs, consts, {"qk_scale", "v_scale"})


def dsa_scores_source(
    q: str = "bf16", cache: str = "fp8e4nv", block_q: int = 1, block_n: int = 64
) -> ASTSource:
    from kernels.dsa_indexer_triton import _dsa_scores_kernel as fn

    ptrs = {
        "q_ptr": q, "w_ptr": "fp32", "k_ptr": cache, "page_table_ptr": "i32", "expected_ptr": "i64",
        "page_tags_ptr": "i64", "seq_lens_ptr": "i32", "query_start_ptr": "i32", "tile_seq_ptr": "i32",
        "tile_q0_ptr": "i32", "mismatch_ptr": "u8", "scores_ptr": "fp32",
    }  # fmt: skip
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, BLOCK_Q=block_q, BLOCK_H=32, BLOCK_N=block_n, BLOCK_D=128, CHECK_TAGS=True,
        COMPUTE=tl.float16 if cache == "fp8e4nv" else _TL[q], DOT_PRECISION="tf32",
    )  # fmt: skip
    return _source(fn, ptrs, consts, {"qk_scale"})


def merge_source(out: str = "bf16") -> ASTSource:
    from kernels.split_k_merge import _merge_kernel as fn

    return _source(
        fn,
        {"part_o_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": out},
        {"BLOCK_S": 4, "BLOCK_R": 512},
        {"v_scale"},
    )


def _source(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], floats: set[str]) -> ASTSource:
    names = fn.arg_names
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
        else:
            sig[n] = "fp32" if n in floats else "i32"
    # pointers and the line strides are 16-byte aligned, as the launchers' tensors are on the GPU
    strides = ("stride_cp", "stride_cs", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "R")
    aligned = [(names.index(n),) for n in names if n.endswith("_ptr") or n in strides]
    return ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={k: [["tt.divisibility", 16]] for k in aligned},
    )


def compile_sm90(src: ASTSource, num_warps: int, num_stages: int = 2, loop_nibbles: int = 0) -> str:
    """Compile to a cubin; return ptxas's register / spill line. With `loop_nibbles` (INT4 weights
    one thread unpacks per trip of the kernel's longest loop), also that loop's SASS: instructions
    per nibble, 16-byte loads, barriers (`loop_stats`)."""
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(kernel.asm["ptx"])
        cubin = os.path.join(tmp, "k.cubin")
        run = subprocess.run(
            [os.path.join(bin_dir, "ptxas"), "-arch=sm_90a", "-v", ptx, "-o", cubin],
            capture_output=True,
            text=True,
        )
        if run.returncode:
            raise RuntimeError(run.stderr[-2000:])
        sass = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "-sass", cubin], capture_output=True, text=True, check=True
        ).stdout
    info = [
        line.split("info    :")[-1].strip()
        for line in run.stderr.splitlines()
        if "spill" in line or "registers" in line
    ]
    line = " ".join(info) + f" smem={kernel.metadata.shared}"
    return line + (" | " + loop_stats(sass, loop_nibbles) if loop_nibbles else "")


def compiled_lines(module: str) -> list[str]:
    """Run `python -m module` (an sm90 compile script) without TRITON_INTERPRET from the repository
    root, for the tests; its output lines, one per kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", module], env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def compile_args() -> argparse.Namespace:
    """The scripts' command line (`--all`), refused under TRITON_INTERPRET."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces what this compiles")
    return args


def loop_stats(sass: str, nibbles: int) -> str:
    """The longest backward-branch loop of `cuobjdump -sass` output: instructions per nibble, and
    counts of the ones that matter to the INT4 GEMVs (LOP3/FFMA per nibble, LDG.E.128, BAR, LDS)."""
    ops = []  # (address, opcode)
    for text in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)(.*)", text)
        if m:
            ops.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ops:
        target = re.search(r"0x([0-9a-f]+)", rest)
        if op.startswith("BRA") and target and int(target.group(1), 16) < addr:
            loops.append((int(target.group(1), 16), addr))
    if not loops:
        return "no loop"
    lo, hi = max(loops, key=lambda b: b[1] - b[0])
    body = [op for addr, op, _ in ops if lo <= addr <= hi]

    def count(prefix: str) -> int:
        return sum(op.startswith(prefix) for op in body)

    return (
        f"loop {len(body) / nibbles:.2f} instr/nibble (LOP3 {count('LOP3') / nibbles:.2f}, "
        f"FFMA {count('FFMA') / nibbles:.2f}) LDG.E.128 {count('LDG.E.128')} BAR {count('BAR')} LDS {count('LDS')}"
    )


# the launchers' defaults for Kimi's 64 heads (must compile without spills) and the benchmark's sweep
DEFAULT_CONFIGS: list[tuple[str, dict[str, Any], int]] = [
    ("mla decode bf16 (default tiles)", {"block_h": 32, "block_n": 16}, 8),
    ("mla decode fp8 (default tiles)", {"cache": "fp8e4nv", "block_h": 32, "block_n": 32}, 8),
    (
        "mla decode fp8 sparse (default tiles)",
        {"cache": "fp8e4nv", "block_h": 32, "block_n": 16, "sparse": True},
        8,
    ),
    (
        "mla prefill fp16 varlen (default tiles)",
        {"q": "fp16", "cache": "fp16", "varlen": True, "block_q": 2},
        8,
    ),
]

# the GQA prefill and DSA indexer launchers' defaults (GLM-4.5-Air 96/8 × 128; GLM-5 indexer 32 × 128)
OTHER_DEFAULTS: list[tuple[str, Any, int]] = [
    ("gqa prefill bf16 (default tiles)", lambda: gqa_prefill_source(block_m=128, block_n=32), 8),
    (
        "gqa prefill fp8 (default tiles)",
        lambda: gqa_prefill_source(cache="fp8e4nv", block_m=128, block_n=32),
        8,
    ),
    ("dsa scores decode fp8 (default tiles)", lambda: dsa_scores_source(block_q=1, block_n=64), 8),
    (
        "dsa scores decode bf16 (default tiles)",
        lambda: dsa_scores_source(cache="bf16", block_q=1, block_n=64),
        8,
    ),
    ("dsa scores prefill fp8 (default tiles)", lambda: dsa_scores_source(block_q=2, block_n=64), 8),
]
ALL_CONFIGS = DEFAULT_CONFIGS + [
    (
        f"mla decode {c} block_h={bh} block_n={bn} warps={w} masked={m}",
        {"cache": c, "block_h": bh, "block_n": bn, "masked": m},
        w,
    )
    for c in ("bf16", "fp8e4nv")
    for bh, bn, w in ((16, 16, 4), (16, 32, 4), (32, 16, 8), (32, 32, 8), (64, 16, 8))
    for m in (False, True)
]


def main() -> None:
    args = compile_args()
    for name, kw, warps in ALL_CONFIGS if args.all else DEFAULT_CONFIGS:
        print(f"{name:<48} {compile_sm90(mla_source(**kw), warps)}", flush=True)
    for name, source, warps in OTHER_DEFAULTS:
        print(f"{name:<48} {compile_sm90(source(), warps)}", flush=True)
    print(f"{'mla merge bf16':<48} {compile_sm90(merge_source(), 4)}", flush=True)
    print(f"{'kv_write fp8 <- bf16':<48} {compile_sm90(kv_write_source(), 4)}", flush=True)
    print(
        f"{'kv_write fp8 <- bf16, tag check off':<48} {compile_sm90(kv_write_source(check=False), 4)}",
        flush=True,
    )


if __name__ == "__main__":
    main()

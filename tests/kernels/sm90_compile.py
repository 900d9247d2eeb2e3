"""Compile the MLA, GQA prefill, DSA indexer and kv_write kernels for sm90 (H200) without a GPU.

CI has no GPU and runs kernels in the interpreter, which never lowers them; this catches what only a
real compile shows (types, layouts, shared memory) and prints ptxas's registers and spills per
config. Run in a process without TRITON_INTERPRET (the interpreter patches `tl`):

    python -m tests.kernels.sm90_compile            # the launchers' default tiles (CI)
    python -m tests.kernels.sm90_compile --all      # every config the benchmark sweeps
    python -m tests.kernels.sm90_compile --fp8-dot  # the MLA FP8-dot tiles alone (`FP8_DOT_TILES`)

Each MLA line ends with its token loop's SASS a token (`mla_loop_stats`).
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

from kernels.mla_tiles import FP8_DOT_TILES, TILES, VARIANTS, MlaTiles

TARGET = GPUTarget("cuda", 90, 32)
_TL = {"bf16": tl.bfloat16, "fp16": tl.float16, "fp32": tl.float32}


def mla_source(
    tiles: MlaTiles, q: str = "bf16", cache: str = "bf16", block_q: int = 1, varlen: bool = False,
    sparse: bool = False, direct: bool = False, check: bool = True, latent: tuple[int, int] = (512, 64),
) -> ASTSource:  # fmt: skip
    """The MLA kernel for `tiles`, a cache line of `latent` = (R, Dr) (Kimi's 512 + 64 by default)."""
    from kernels.mla_decode import _mla_paged_kernel as fn

    ptrs = {
        "q_ptr": q, "cache_ptr": cache, "page_table_ptr": "i32", "clean_table_ptr": "i32", "expected_ptr": "i64",
        "page_tags_ptr": "i64", "seq_lens_ptr": "i32", "query_start_ptr": "i32", "tile_seq_ptr": "i32",
        "tile_q0_ptr": "i32", "topk_ptr": "i64", "mismatch_ptr": "u8", "part_o_ptr": "fp32", "part_lse_ptr": "fp32",
        "out_ptr": q,
    }  # fmt: skip
    fp8 = cache == "fp8e4nv"
    fp8_dot = fp8 and tiles.fp8_dot
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, BLOCK_Q=block_q, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_RC=tiles.block_rc,
        NUM_RC=latent[0] // tiles.block_rc, BLOCK_DR=max(32 if fp8_dot else 16, latent[1]),
        BLOCK_P=512 if sparse else 1024, VARLEN=varlen, SPARSE=sparse,
        CHECK_TAGS=check, DIRECT=direct,
        COMPUTE=tl.float8e4nv if fp8_dot else tl.float16 if fp8 else _TL[q],
        DOT_PRECISION="ieee" if q == "fp32" else "tf32", NUM_STAGES=tiles.num_stages, FP8_ASM=fp8,
        FP8_SHIFT=fp8 and tiles.fp8_shift and not fp8_dot, SWAP=tiles.swap, FP8_DOT=fp8_dot,
    )  # fmt: skip
    return _source(fn, ptrs, consts, {"qk_scale", "v_scale"})


def kv_write_source(
    cache: str = "fp8e4nv", values: str = "bf16", check: bool = True, two: bool = False
) -> ASTSource:
    """The kv_write kernel for one cache line of 576 (`two`: and a second cache's line of 128, the DSA
    indexer's keys, in the same launch)."""
    from kernels.kv_write_triton import _kv_write_kernel as fn

    ptrs = {
        "cache_ptr": cache, "values_ptr": values, "cache2_ptr": cache, "values2_ptr": values, "slot_ptr": "i64",
        "page_tags_ptr": "i64", "token_expected_ptr": "i64", "token_seq_ptr": "i64", "mismatch_ptr": "u8",
    }  # fmt: skip
    quant = cache == "fp8e4nv"
    consts = dict(
        PAGE_SIZE=16, BLOCK_W=1024, BLOCK_W2=128, QUANT=quant, FMAX=448.0 if quant else 0.0, QUANT2=quant,
        FMAX2=448.0 if quant else 0.0, TWO=two, CHECK_TAGS=check,
    )  # fmt: skip
    return _source(fn, ptrs, consts, {"scale", "scale2"})


def merge_source(out: str = "bf16") -> ASTSource:
    from kernels.split_k_merge import _merge_kernel as fn

    return _source(
        fn,
        {"part_o_ptr": "fp32", "part_lse_ptr": "fp32", "out_ptr": out},
        {"BLOCK_S": 128, "CHUNK_S": 8, "BLOCK_R": 128},
        {"v_scale"},
    )


def launch_consts(fn: Any, consts: dict[str, Any]) -> dict[str, Any]:
    """`consts` with PDL off where `fn` takes the constexpr (`kernels/triton_lib.py`), as every
    launch before sm_90 or with the switch off compiles it; `sm90_compile_pdl` turns it on."""
    return {"PDL": False, **consts} if "PDL" in fn.arg_names else consts


def _source(fn: Any, ptrs: dict[str, str], consts: dict[str, Any], floats: set[str]) -> ASTSource:
    names = fn.arg_names
    consts = launch_consts(fn, consts)
    sig = {}
    for n in names:
        if n in consts:
            sig[n] = "constexpr"
        elif n in ptrs:
            sig[n] = "*" + ptrs[n]
        else:
            sig[n] = "fp32" if n in floats else "i32"
    # pointers and the line strides are 16-byte aligned, as the launchers' tensors are on the GPU
    strides = (
        "stride_cp", "stride_cs", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "R", "DR",
        "stride_ptb", "stride_etb", "stride_tkt",
    )  # fmt: skip
    aligned = [(names.index(n),) for n in names if n.endswith("_ptr") or n in strides]
    return ASTSource(
        fn=fn,
        signature=sig,
        constexprs={(names.index(n),): v for n, v in consts.items()},
        attrs={k: [["tt.divisibility", 16]] for k in aligned},
    )


def compile_sm90(
    src: ASTSource, num_warps: int, num_stages: int = 2, maxnreg: int | None = None, loop_nibbles: int = 0,
    loop_tokens: int = 0,
) -> str:  # fmt: skip
    """Compile to a cubin; return ptxas's register / spill line (`maxnreg`: a register cap, as at
    launch). With `loop_nibbles` (INT4 weights one thread unpacks per trip of the kernel's longest
    loop), also that loop's SASS: instructions per nibble, 16-byte loads, barriers (`loop_stats`);
    with `loop_tokens` (MLA: the tokens of a step), its instructions a token (`mla_loop_stats`)."""
    options = {"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg}
    kernel = triton.compile(src, target=TARGET, options=options)
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
    if loop_tokens:
        line += " | " + mla_loop_stats(longest_loop(sass), loop_tokens, num_warps)
    return line + (" | " + loop_stats(sass, loop_nibbles) if loop_nibbles else "")


def compiled_lines(module: str, *args: str) -> list[str]:
    """Run `python -m module *args` (an sm90 compile script) without TRITON_INTERPRET from the
    repository root, for the tests; its output lines, one per kernel."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run(
        [sys.executable, "-m", module, *args], env=env, cwd=Path(__file__).parents[2], capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def compile_args(*flags: str) -> argparse.Namespace:
    """The scripts' command line (`--all`, and `flags`), refused under TRITON_INTERPRET."""
    ap = argparse.ArgumentParser()
    for flag in ("--all", *flags):
        ap.add_argument(flag, action="store_true")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces what this compiles")
    return args


def longest_loop(sass: str) -> list[str]:
    """The opcodes of the longest backward-branch loop of `cuobjdump -sass` output (none: [])."""
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
        return []
    # a branch back across an EXIT is not the K loop (TMA kernels retry their barrier wait from code
    # placed after the epilogue, jumping back into the loop)
    exits = [addr for addr, op, _ in ops if op == "EXIT"]
    loops = [b for b in loops if not any(b[0] <= e <= b[1] for e in exits)] or loops
    lo, hi = max(loops, key=lambda b: b[1] - b[0])
    return [op for addr, op, _ in ops if lo <= addr <= hi]


def loop_stats(sass: str, nibbles: int) -> str:
    """The longest loop's (`longest_loop`) instructions per nibble, and counts of the ones that matter
    to the INT4 GEMVs (LOP3/FFMA per nibble, 16-byte LDGs, BAR, LDS)."""
    body = longest_loop(sass)
    if not body:
        return "no loop"

    def count(prefix: str) -> int:
        return sum(op.startswith(prefix) for op in body)

    wide_loads = sum(op.startswith("LDG") and op.endswith(".128") for op in body)  # any cache hint

    return (
        f"loop {len(body) / nibbles:.2f} instr/nibble (LOP3 {count('LOP3') / nibbles:.2f}, "
        f"FFMA {count('FFMA') / nibbles:.2f}) LDG.128 {wide_loads} BAR {count('BAR')} LDS {count('LDS')}"
    )


# the MLA token loop's instructions that tell where a step goes: tensor-core MMAs (fp8 wgmma, 16-bit
# wgmma, mma.sync), shared memory (cp.async in, LDS / LDSM out, STS: a tile stored again in another
# layout), barriers; and each kind of conversion (F2FP.F16.E4M3: e4m3 to fp16, the lines' or P's for
# its sum; F2FP.SATFINITE.E4M3: fp32 to e4m3, P's; F2FP.F16.F32 / BF16.F32: P to 16 bits)
MLA_OPS = ("QGMMA", "HGMMA", "HMMA", "LDGSTS", "LDS", "LDSM", "STS", "BAR")


def mla_loop_stats(body: list[str], tokens: int, num_warps: int) -> str:
    """The token loop's size: instructions a warp issues per step, warp instructions a token (all
    warps), and per token those of `MLA_OPS` (LDS counts neither LDSM nor LDS of other prefixes)
    and of each F2FP kind."""
    if not body:
        return "no loop"
    kinds = [op.split(".")[0] if not op.startswith("F2FP") else ".".join(op.split(".")[:3]) for op in body]
    names = list(MLA_OPS) + sorted({k for k in kinds if k.startswith("F2FP")})
    counts = " ".join(f"{n} {kinds.count(n) * num_warps / tokens:.2f}" for n in names)
    return f"loop {len(body)} instr/warp a step, {len(body) * num_warps / tokens:.1f} warp instr/token ({counts})"


def mla_configs(
    table: dict[tuple[str, int, bool], list[MlaTiles]],
) -> list[tuple[str, dict[str, Any], MlaTiles]]:
    """(name, mla_source kwargs, tiles) for each entry: bf16 queries (as the engine runs them), a bf16
    or FP8 cache; prefill tiles of 64 // block_h queries."""
    out = []
    for (mode, rows, fp8), entries in table.items():
        kw: dict[str, Any] = {"cache": "fp8e4nv" if fp8 else "bf16", "sparse": mode == "sparse"}
        if mode == "prefill":
            kw.update(varlen=True, block_q=rows // entries[0].block_h)
        for t in entries:
            out.append((f"mla {mode} {kw['cache']} {rows} rows {t.label()}", kw, t))
    return out


# the launchers' defaults (must compile without spills) and, with --all, the benchmark's variants
MLA_DEFAULT_KEYS = [
    ("decode", 64, False), ("decode", 64, True), ("decode", 16, False), ("decode", 16, True), ("sparse", 64, True),
    ("prefill", 64, False),
]  # fmt: skip
DEFAULT_CONFIGS = mla_configs({k: [TILES[k]] for k in MLA_DEFAULT_KEYS})
FP8_DOT_CONFIGS = mla_configs({(mode, rows, True): [t] for (mode, rows), t in FP8_DOT_TILES.items()})
ALL_CONFIGS = mla_configs({k: [t, *VARIANTS.get(k, [])] for k, t in TILES.items() if k[1] != 32})


def ctas_per_sm(info: str, num_warps: int) -> int:
    """CTAs an H100/H200 SM holds for a compile line: 64K registers (256 a warp at a time), 228 KB of
    shared memory (1 KB reserved a CTA), 64 warps."""
    regs = int(re.search(r"Used (\d+) registers", info).group(1))
    smem = int(re.search(r"smem=(\d+)", info).group(1))
    by_regs = 65536 // (triton.cdiv(regs * 32, 256) * 256 * num_warps)
    return min(by_regs, 228 * 1024 // (smem + 1024), 64 // num_warps)


def main() -> None:
    args = compile_args("--fp8-dot")
    overbooked = []
    configs = FP8_DOT_CONFIGS if args.fp8_dot else ALL_CONFIGS if args.all else DEFAULT_CONFIGS
    for name, kw, tiles in configs:
        src = mla_source(tiles, **kw)
        info = compile_sm90(src, tiles.num_warps, tiles.num_stages, loop_tokens=tiles.block_n)
        fits = ctas_per_sm(info, tiles.num_warps)
        print(f"{name:<48} {info} ctas/SM={fits}", flush=True)
        if tiles.ctas_per_sm > fits:
            overbooked.append(f"{name}: the table says {tiles.ctas_per_sm} CTAs an SM, {fits} fit")
    if args.fp8_dot:
        sys.exit("\n".join(overbooked) or None)
    from tests.kernels.sm90_compile_gqa import DEFAULTS as GQA_DEFAULTS  # it imports this module

    for name, build in GQA_DEFAULTS:  # GQA prefill and the DSA scoring (GQA decode: sm90_compile_gqa alone)
        if not name.startswith("gqa decode"):
            print(f"{name:<48} {compile_sm90(*build())}", flush=True)
    print(f"{'mla merge bf16':<48} {compile_sm90(merge_source(), 4)}", flush=True)
    print(f"{'kv_write fp8 <- bf16':<48} {compile_sm90(kv_write_source(), 4)}", flush=True)
    print(
        f"{'kv_write fp8 <- bf16, tag check off':<48} {compile_sm90(kv_write_source(check=False), 4)}",
        flush=True,
    )
    print(
        f"{'kv_write fp8 <- bf16, latent + indexer keys':<48} {compile_sm90(kv_write_source(two=True), 4)}",
        flush=True,
    )
    if overbooked:
        sys.exit("\n".join(overbooked))


if __name__ == "__main__":
    main()

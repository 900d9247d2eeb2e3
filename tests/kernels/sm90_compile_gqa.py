"""Compile the GQA decode, GQA prefill and DSA scoring kernels for sm90 (H200) without a GPU.

Like `tests/kernels/sm90_compile_w4a8.py` (whose `_source` this reuses), the integer arguments a
real launch sees divisible by 16 (head dims, row and page strides) are marked so: without that,
Triton cannot prove the K/V rows 16-byte aligned and loads them byte by byte, which is not what the
H200 runs. `--sass` adds, per kernel, the instruction mix of its longest loop (the hot loop) from
the bundled `cuobjdump`: the evidence behind the tile tables. Run without TRITON_INTERPRET:

    python -m tests.kernels.sm90_compile_gqa           # the launchers' default tiles (tested)
    python -m tests.kernels.sm90_compile_gqa --all --sass
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from typing import Any

import torch
import triton
import triton.language as tl
from triton.compiler import ASTSource

from tests.kernels.sm90_compile import TARGET, compile_sm90
from tests.kernels.sm90_compile_w4a8 import _source

DIV16 = (
    "D", "DV", "DI", "stride_qb", "stride_qh", "stride_qt", "stride_kp", "stride_ks", "stride_kh", "stride_vp",
    "stride_vs", "stride_vh", "stride_ot", "stride_oh",
)  # fmt: skip
Build = tuple[ASTSource, int, int, "int | None"]  # source, warps, stages, register cap
DTYPES = {"bf16": torch.bfloat16, "fp8e4nv": torch.float8_e4m3fn}
KV_PTRS = {"page_table_ptr": "i32", "expected_ptr": "i64", "page_tags_ptr": "i64", "mismatch_ptr": "u8"}


def _kv_consts(cache: str, q: str) -> dict[str, Any]:
    return {"COMPUTE": tl.float16 if cache == "fp8e4nv" else getattr(tl, {"bf16": "bfloat16"}.get(q, q))}


def decode_source(
    cache: str = "bf16", tiles: str | None = None, check: bool = True
) -> tuple[ASTSource, int, int]:
    """GLM-4.5-Air's decode (12 heads per KV head, d 128, page 16) with a DECODE_TILES entry."""
    from kernels.paged_decode_gqa import _paged_decode_gqa_kernel, decode_tiles

    cfg = decode_tiles(tiles, DTYPES[cache])
    ptrs = {"q_ptr": "bf16", "k_ptr": cache, "v_ptr": cache, "seq_lens_ptr": "i32", **KV_PTRS,
            "part_o_ptr": "fp32", "part_lse_ptr": "fp32"}  # fmt: skip
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, GROUP=12, BLOCK_H=16, BLOCK_N=cfg.block_n, BLOCK_P=1024, BLOCK_D=128, BLOCK_DV=128,
        CHECK_TAGS=check, DOT_PRECISION="tf32", EVEN_D=True, SHARED_OFFSETS=True, SPLIT_V=cfg.split_v,
        LAZY_SUM=cfg.lazy_sum, ASM=True, **_kv_consts(cache, "bf16"),
    )  # fmt: skip
    return (
        _source(_paged_decode_gqa_kernel, ptrs, consts, {"qk_scale"}, DIV16, ()),
        cfg.num_warps,
        cfg.num_stages,
        cfg.max_registers,
    )


def prefill_source(
    cache: str = "bf16", tiles: str | None = None, q: str = "bf16", check: bool = False
) -> tuple[ASTSource, int, int]:
    """GLM-4.5-Air's prefill tiles (rows = 10 queries × 12 heads) with a PREFILL_TILES entry; the first
    launch (no tag read), or with `check` the second (the tag check and the checked re-walk)."""
    from kernels.paged_prefill_gqa import _paged_prefill_gqa_kernel, prefill_tiles

    cfg = prefill_tiles(tiles, DTYPES[cache])
    ptrs = {"q_ptr": q, "k_ptr": cache, "v_ptr": cache, "seq_lens_ptr": "i32", "query_start_ptr": "i32",
            "tile_seq_ptr": "i32", "tile_q0_ptr": "i32", **KV_PTRS, "part_o_ptr": "fp32",
            "part_lse_ptr": "fp32", "out_ptr": q}  # fmt: skip
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, GROUP=12, BLOCK_Q=cfg.block_m // 12, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_P=1024, BLOCK_D=128, BLOCK_DV=128, CHECK_TAGS=check, DIRECT=True, DOT_PRECISION="tf32",
        EVEN_D=True, SHARED_OFFSETS=True, SPLIT_V=cfg.split_v, LAZY_SUM=cfg.lazy_sum, ASM=True,
        **_kv_consts(cache, q),
    )  # fmt: skip
    src = _source(_paged_prefill_gqa_kernel, ptrs, consts, {"qk_scale", "v_scale"}, DIV16, ())
    return src, cfg.num_warps, cfg.num_stages, cfg.max_registers


def dsa_source(
    cache: str = "fp8e4nv", prefill: bool = False, tiles: str | None = None, check: bool = True
) -> tuple[ASTSource, int, int]:
    """GLM-5's indexer scoring (32 heads × 128, page 16) with an INDEXER_TILES entry."""
    from kernels.dsa_indexer_triton import _dsa_scores_kernel, indexer_config, tag_pages

    cfg = indexer_config(tiles, DTYPES[cache], prefill)
    block_q = 2 if prefill else 1
    ptrs = {"q_ptr": "bf16", "w_ptr": "fp32", "k_ptr": cache, "seq_lens_ptr": "i32", "query_start_ptr": "i32",
            "tile_seq_ptr": "i32", "tile_q0_ptr": "i32", **KV_PTRS, "scores_ptr": "fp32"}  # fmt: skip
    consts: dict[str, Any] = dict(
        PAGE_SIZE=16, BLOCK_Q=block_q, BLOCK_H=32, BLOCK_N=cfg.block_n, BLOCK_D=128, CHECK_TAGS=check,
        TAGS_PER_PAGE=not prefill,
        DOT_PRECISION="tf32", STEPS=cfg.steps, TAG_PAGES=tag_pages(cfg.block_n * cfg.steps, 16),
        **_kv_consts(cache, "bf16"),
    )  # fmt: skip
    src = _source(_dsa_scores_kernel, ptrs, consts, {"qk_scale"}, DIV16, ())
    return src, cfg.num_warps, cfg.num_stages, None


def resident(line: str, num_warps: int) -> int:
    """Programs an H200 SM holds at once, from a `compile_sm90` line: registers (8 a thread at a time),
    shared memory (228 KiB, 1 KiB reserved a program), threads (2048)."""
    regs = int(re.search(r"Used (\d+) registers", line).group(1))
    smem = int(re.search(r"smem=(\d+)", line).group(1))
    by_regs = 65536 // (-(-regs // 8) * 8 * 32 * num_warps)
    return min(by_regs, 233472 // (smem + 1024), 2048 // (32 * num_warps), 32)


def hot_loop_mix(src: ASTSource, num_warps: int, num_stages: int, maxnreg: int | None = None) -> str:
    """The loops' lengths in SASS, in code order, and the opcode mix of the first long one: the hot
    loop (the tag-checked re-walk of a bad slice comes after it)."""
    options = {"num_warps": num_warps, "num_stages": num_stages, "maxnreg": maxnreg}
    kernel = triton.compile(src, target=TARGET, options=options)
    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    where = {a: i for i, (a, _) in enumerate(code)}
    loops = [  # (first, last) index of each backward branch's body
        (where[int(m.group(1), 16)], i)
        for i, (a, t) in enumerate(code)
        if (m := re.search(r"BRA\s+0x([0-9a-f]+)", t))
        and int(m.group(1), 16) in where
        and int(m.group(1), 16) < a
    ]
    long = [r for r in loops if r[1] - r[0] >= 100]
    lo, hi = long[0] if long else (0, len(code) - 1)  # no long loop (a one-step DSA program): all of it
    ops = collections.Counter(
        re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for _, t in code[lo : hi + 1]
    )
    sizes = ",".join(str(b - a + 1) for a, b in loops)
    return f"loops {sizes or '-'}; {'hot' if long else 'kernel'} {hi - lo + 1}: " + " ".join(
        f"{op}:{n}" for op, n in ops.most_common(16)
    )


DEFAULTS: list[tuple[str, Any]] = [
    ("gqa decode bf16 (default tiles)", lambda: decode_source("bf16")),
    ("gqa decode fp8 (default tiles)", lambda: decode_source("fp8e4nv")),
    ("gqa prefill bf16 (default tiles)", lambda: prefill_source("bf16")),
    ("gqa prefill fp8 (default tiles)", lambda: prefill_source("fp8e4nv")),
    ("gqa prefill bf16 check launch", lambda: prefill_source("bf16", check=True)),
    ("gqa prefill fp8 check launch", lambda: prefill_source("fp8e4nv", check=True)),
    ("dsa scores decode bf16 (default tiles)", lambda: dsa_source("bf16")),
    ("dsa scores decode fp8 (default tiles)", lambda: dsa_source("fp8e4nv")),
    ("dsa scores prefill fp8 (default tiles)", lambda: dsa_source("fp8e4nv", prefill=True)),
]


def every_entry() -> list[tuple[str, Any]]:
    """Each table entry the benchmarks time."""
    from kernels.dsa_indexer_triton import INDEXER_TILES
    from kernels.paged_decode_gqa import DECODE_TILES
    from kernels.paged_prefill_gqa import PREFILL_TILES

    cache = {"bf16": "bf16", "fp8": "fp8e4nv"}
    rows = [(f"gqa decode {n}", lambda n=n: decode_source(cache[n.split("/")[0]], n)) for n in DECODE_TILES]
    rows += [
        (f"gqa prefill {n}", lambda n=n: prefill_source(cache[n.split("/")[0]], n)) for n in PREFILL_TILES
    ]
    for n in INDEXER_TILES:
        kv, kind = n.split("/")[:2]
        rows.append(
            (f"dsa scores {n}", lambda n=n, kv=kv, kind=kind: dsa_source(cache[kv], kind == "prefill", n))
        )
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--all", action="store_true", help="every tile-table entry, not only the defaults")
    ap.add_argument("--sass", action="store_true", help="the hot loop's instruction mix too")
    args = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: the interpreter replaces what this compiles")
    for name, build in every_entry() if args.all else DEFAULTS:
        built = build()
        line = compile_sm90(*built)
        print(f"{name:<44} {line} resident={resident(line, built[1])}", flush=True)
        if args.sass:
            print(f"{'':<6}{hot_loop_mix(*built)}", flush=True)


if __name__ == "__main__":
    main()

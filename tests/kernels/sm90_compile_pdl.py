"""Compile every kernel the launchers start with PDL (`kernels/triton_lib.py`) for sm90 with its PDL
constexpr on, and read each one's PTX against the rules written there: griddepcontrol.launch_dependents
then griddepcontrol.wait, once each; no global store or atomic before the wait; global reads (loads,
L2 prefetches) before it only in the kernels that read constants there (`PREFETCH`). The interpreter (CPU CI) never compiles
the wait, so this is where CI sees it lower. The sources are the other sm90 scripts' (the launchers'
default tiles at GLM-5 / Kimi shapes), with PDL turned on. Run without TRITON_INTERPRET:

    python -m tests.kernels.sm90_compile_pdl

One line per kernel, `name | launch_dependents=N wait=N reads_before_wait=N stores_before_wait=N
launch_first=B | sass_reads_before_wait=N sass_stores_before_wait=N`: the PTX's count, then the
machine code's (ptxas could still move a load across; there the wait is ACQBULK, launch_dependents
PREEXIT, an L2 prefetch CCTL.E.PF2), and a last line for RMSNorm compiled with PDL off (no griddepcontrol at all: the variant
every launch before sm_90 or with the switch off runs), then the PDL kernels of the package not
compiled here (none, or the list is stale). `tests/kernels/test_pdl.py` checks them.
"""

from __future__ import annotations

import importlib
import os
import pkgutil
import re
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import replace

import triton
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tests.kernels.sm90_compile import TARGET, compile_args

# the kernels that read constants before their wait (rule 2): a GEMV's first weight tile (into L2, or
# registers; the TMA GEMV: its first scales), a norm's weight, the router's bias, the FP8 tiles'
# per-channel scales, the gate's GEMV's first weight tile
PREFETCH = (
    "w4a16 gemv",
    "w4a16 gemv prefetch",
    "w4a16 gemv tma",
    "fp8 gemv",
    "fp8 tiles channel",
    "rms_norm",
    "route",
    "router_logits",
)
_READ = re.compile(r"\b(ld\.global|cp\.async|prefetch\.global)")
_STORE = re.compile(r"\b(st|atom|red)\.global\b")
_SASS_OP = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")


def with_pdl(src: ASTSource, on: bool = True) -> ASTSource:
    """`src` (the sm90 scripts build PDL off) with its PDL constexpr set to `on`."""
    index = (src.fn.arg_names.index("PDL"),)
    assert index in src.constants, f"{src.name} takes no PDL constexpr"
    return ASTSource(src.fn, src.signature, {**src.constants, index: on}, src.attrs)


def ptx_stats(ptx: str) -> str:
    """The PDL facts of a kernel's PTX, as one line (the module docstring's format)."""
    lines = ptx.splitlines()
    waits = [i for i, line in enumerate(lines) if "griddepcontrol.wait" in line]
    launches = [i for i, line in enumerate(lines) if "griddepcontrol.launch_dependents" in line]
    before = lines[: waits[0]] if waits else []
    reads = sum(bool(_READ.search(line)) for line in before)
    stores = sum(bool(_STORE.search(line)) for line in before)
    first = bool(launches and waits and launches[0] < waits[0])
    return (
        f"launch_dependents={len(launches)} wait={len(waits)} reads_before_wait={reads} "
        f"stores_before_wait={stores} launch_first={first}"
    )


def cases() -> list[tuple[str, Callable[[], tuple[ASTSource, int, int]]]]:
    """(name, build -> (source PDL off, warps, stages)) for every PDL kernel, by op."""
    from kernels.fp8_gemm import GEMV_DEFAULT as FP8_GEMV
    from kernels.fp8_gemm import TILE_DEFAULTS as FP8_TILES
    from kernels.mla_tiles import TILES
    from kernels.moe_routing import GEMV_CONFIG, TILE_CONFIGS
    from kernels.w4a16_config import GEMV_DEFAULT, GEMV_TMA, TILE_DEFAULTS
    from tests.kernels import sm90_compile_fp8, sm90_compile_fused_moe, sm90_compile_int4
    from tests.kernels.sm90_compile import kv_write_source, merge_source, mla_source
    from tests.kernels.sm90_compile_gqa import dsa_source
    from tests.kernels.sm90_compile_small_ops import builds

    def int4(case: tuple[ASTSource, int, int, int]) -> tuple[ASTSource, int, int]:
        return case[:3]

    def small(prefix: str) -> tuple[ASTSource, int, int]:
        return next((src, warps, 1) for name, src, warps in builds() if name.startswith(prefix))

    mla = TILES[("decode", 64, False)]
    sparse = TILES[("sparse", 64, True)]
    return [
        ("w4a16 gemv", lambda: int4(sm90_compile_int4.gemm_case(GEMV_DEFAULT, 32))),
        ("w4a16 gemv prefetch", lambda: int4(sm90_compile_int4.gemm_case(replace(GEMV_DEFAULT, prefetch=True), 32))),
        ("w4a16 gemv tma", lambda: int4(sm90_compile_int4.gemm_case(GEMV_TMA, 32))),
        ("w4a16 tiles", lambda: int4(sm90_compile_int4.gemm_case(TILE_DEFAULTS[0][1], 32))),
        ("fp8 gemv", lambda: (sm90_compile_fp8.source(FP8_GEMV, "bf16", True), FP8_GEMV.num_warps, FP8_GEMV.num_stages)),
        ("fp8 tiles channel", lambda: (sm90_compile_fp8.source(FP8_TILES[0][1], "bf16", False), 4, FP8_TILES[0][1].num_stages)),
        ("int4 moe gemv gate_up", lambda: int4(sm90_compile_int4.moe_case(GEMV_CONFIG, True))),
        ("int4 moe gemv down", lambda: int4(sm90_compile_int4.moe_case(GEMV_CONFIG, False))),
        ("int4 moe tiles gate_up", lambda: int4(sm90_compile_int4.moe_case(TILE_CONFIGS[0][1], True))),
        ("moe align", lambda: int4(sm90_compile_int4.align_case(8))),
        ("fp8 moe gemv gate_up", lambda: sm90_compile_fused_moe.gemv_source(True, True)),
        ("fp8 moe tiles down", lambda: sm90_compile_fused_moe.tiles_source(False, True, 64 * 8)),
        ("rms_norm", lambda: small("rms_norm hidden")),
        ("row_norms", lambda: small("row_norms")),
        ("rope", lambda: small("rope q_pe")),
        ("rope 4 tensors", lambda: small("rope DSA layer")),
        ("silu_mul", lambda: small("silu_mul")),
        ("route", lambda: small("route 256")),
        ("router_logits", lambda: small("router_logits")),
        ("selection keys", lambda: small("selection keys")),
        ("selection radix", lambda: small("selection radix 2176")),
        ("selection radix resident", lambda: small("selection radix resident 2176")),
        ("kv_write", lambda: (kv_write_source(), 4, 1)),
        ("kv_write two caches", lambda: (kv_write_source(two=True), 4, 1)),
        ("mla decode", lambda: (mla_source(mla), mla.num_warps, mla.num_stages)),
        ("mla sparse fp8", lambda: (mla_source(sparse, cache="fp8e4nv", sparse=True), sparse.num_warps, sparse.num_stages)),
        ("mla merge", lambda: (merge_source(), 4, 1)),
        ("dsa scores", lambda: dsa_source("fp8e4nv")[:3]),
    ]  # fmt: skip


def sass_stats(cubin: bytes) -> str:
    """Global reads (LDG, L2 prefetches, TMA and cp.async loads) and writes (STG, atomics, reductions)
    placed before the wait (ACQBULK) in the machine code, by address."""
    bin_dir = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        sass = subprocess.run(
            [os.path.join(bin_dir, "cuobjdump"), "-sass", path], capture_output=True, text=True, check=True
        ).stdout
    ops = [m.group(2) for line in sass.splitlines() if (m := _SASS_OP.match(line))]
    before = ops[: ops.index("ACQBULK")] if "ACQBULK" in ops else []
    reads = sum(op.startswith(("LDG", "LDGSTS", "UTMALDG", "CCTL.E.PF")) for op in before)
    stores = sum(op.startswith(("STG", "ATOMG", "REDG", "RED.")) for op in before)
    return f"sass_reads_before_wait={reads} sass_stores_before_wait={stores}"


def stats(src: ASTSource, num_warps: int, num_stages: int) -> str:
    kernel = triton.compile(src, target=TARGET, options={"num_warps": num_warps, "num_stages": num_stages})
    return f"{ptx_stats(kernel.asm['ptx'])} | {sass_stats(kernel.asm['cubin'])}"


def pdl_kernels() -> set[str]:
    """Every `_*_kernel` of the kernels package that takes the PDL constexpr (its launcher passes
    `pdl_args`, so it runs with PDL on a Hopper GPU)."""
    import kernels

    names = set()
    for info in pkgutil.iter_modules(kernels.__path__, "kernels."):
        for name, obj in vars(importlib.import_module(info.name)).items():
            if isinstance(obj, JITFunction) and name.endswith("_kernel") and "PDL" in obj.arg_names:
                names.add(name)
    return names


def main() -> None:
    compile_args()
    covered = set()
    for name, build in cases():
        src, warps, stages = build()
        covered.add(src.fn.__name__)
        print(f"{name} | {stats(with_pdl(src), warps, stages)}", flush=True)
    src, warps, stages = dict(cases())["rms_norm"]()
    print(f"rms_norm pdl off | {stats(with_pdl(src, False), warps, stages)}", flush=True)
    print(f"not compiled here: {', '.join(sorted(pdl_kernels() - covered)) or 'none'}")


if __name__ == "__main__":
    main()

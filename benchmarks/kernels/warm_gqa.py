"""Compile every GQA decode, GQA prefill and DSA scoring tile-table entry (check on and off) in parallel
processes, so that the `--quick` benchmarks of one device call time kernels instead of compiling them.

Each task launches its launcher once on small inputs specialised as the benchmarks' are (Triton keys a
compile on constexprs and on which integer arguments are 1 or divisible by 16): batch 64 with two
slices for decode, one sequence in one slice for prefill, one launch of all query tiles for the DSA
scoring. The compiled kernels land in Triton's on-disk cache, which the benchmark processes then hit;
a task whose specialisation differs only costs that compile again later.

    python3 -m benchmarks.kernels.warm_gqa [--jobs 12]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import torch

PAGE, D, HQ, HKV, HI = 16, 128, 96, 8, 32


def _paged(B: int, ctx: int, heads: tuple[int, ...], fp8: bool) -> dict:
    dev, pages_per = "cuda", ctx // PAGE
    P = B * pages_per
    table = torch.randperm(P, device=dev).to(torch.int32).reshape(B, pages_per)
    tags = torch.randint(0, 2**40, (P,), device=dev)
    k = torch.randn(P, PAGE, *heads, device=dev, dtype=torch.bfloat16)
    if fp8:
        k = k.to(torch.float8_e4m3fn)
    return dict(
        k=k, table=table, tags=tags, expected=tags[table.long()], flags=torch.zeros(B, dtype=torch.bool, device=dev),
        seq_lens=torch.full((B,), ctx, dtype=torch.int32, device=dev),
    )  # fmt: skip


def warm(task: tuple[str, str, bool]) -> str:
    """Launch one (kernel, entry, check) once; returns the task and its seconds."""
    kernel, name, check = task
    t0 = time.perf_counter()
    fp8 = name.startswith("fp8")
    if kernel == "decode":
        from kernels.paged_decode_gqa import paged_decode_gqa

        p = _paged(64, 512, (HKV, D), fp8)
        q = torch.randn(64, HQ, D, device="cuda", dtype=torch.bfloat16)
        paged_decode_gqa(q, p["k"], p["k"].clone(), 0.1, 0.1, p["seq_lens"], p["table"], p["expected"], p["tags"],
                         p["flags"], D**-0.5, check_tags=check, tiles=name)  # fmt: skip
    elif kernel == "prefill":
        from kernels.paged_prefill_gqa import paged_prefill_gqa

        p = _paged(1, 1024, (HKV, D), fp8)
        q = torch.randn(1024, HQ, D, device="cuda", dtype=torch.bfloat16)
        qs = torch.tensor([0, 1024], dtype=torch.int32, device="cuda")
        paged_prefill_gqa(q, p["k"], p["k"].clone(), 0.1, 0.1, qs, p["seq_lens"], p["table"], p["expected"],
                          p["tags"], p["flags"], D**-0.5, check_tags=check, tiles=name)  # fmt: skip
    else:
        from kernels.dsa_indexer_triton import dsa_indexer

        B, ctx, chunk = (64, 1024, 1) if "/decode/" in name else (1, 2048, 256)
        p = _paged(B, ctx, (D,), fp8)
        q = torch.randn(B * chunk, HI, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(B * chunk, HI, device="cuda")
        qs = torch.arange(B + 1, dtype=torch.int32, device="cuda") * chunk
        dsa_indexer(q, w, p["k"], 0.1, qs, p["seq_lens"], p["table"], p["expected"], p["tags"], p["flags"],
                    D**-0.5, 2048, check_tags=check, config=name)  # fmt: skip
    torch.cuda.synchronize()
    return f"{kernel} {name} check={check} {time.perf_counter() - t0:.1f}s"


def tasks() -> list[tuple[str, str, bool]]:
    from kernels import dsa_indexer_triton as dsa
    from kernels import paged_decode_gqa as dec
    from kernels import paged_prefill_gqa as pre

    out = [("decode", n, True) for n in dec.DECODE_TILES] + [("prefill", n, True) for n in pre.PREFILL_TILES]
    out += [("dsa", n, True) for n in dsa.INDEXER_TILES]
    # the tag-check rows' "off" arms: the default entries (FP8 only for the DSA)
    out += [("decode", n, False) for n in set(dec.DEFAULT_TILES.values())]
    out += [("prefill", n, False) for n in set(pre.DEFAULT_TILES.values())]
    fp8_dsa = [dsa.DEFAULT_TILES[("fp8", kind)] for kind in ("decode", "prefill")]
    out += [("dsa", n, False) for n in fp8_dsa]
    return sorted(out, key=lambda t: t[0] != "prefill")  # the slowest compiles first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=12)
    args = ap.parse_args()
    t0 = time.perf_counter()
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for line in pool.map(warm, tasks()):
            print(line, flush=True)
    print(f"warm: {len(tasks())} compiles in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

"""Compile every GQA decode, GQA prefill and DSA scoring tile-table entry (check on and off) in parallel
processes, so that the `--quick` benchmarks of one device call time kernels instead of compiling them.
`--tag-check`: only what the benchmarks' `--tag-check` runs launch (both arms of each A/B row: the
default entries, GQA prefill's `bf16/v4`, and MLA decode with an FP8 latent at 64 and 8 heads, dense
and top-2048 sparse).

Each task launches its launcher once on small inputs specialised as the benchmarks' are (Triton keys a
compile on constexprs and on which integer arguments are 1 or divisible by 16): batch 64 with two
slices for decode, one sequence in one slice for prefill, one launch of all query tiles for the DSA
scoring, batch 64 at 4k tokens for MLA (the same slices per sequence as at 32k). The compiled kernels
land in Triton's on-disk cache, which the benchmark processes then hit; a task whose specialisation
differs only costs that compile again later.

    python3 -m benchmarks.kernels.warm_gqa [--jobs 12] [--tag-check]
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
    """Launch one (kernel, entry, check) once; returns the task and its seconds (MLA: the entry is
    `HEADS/dense` or `HEADS/sparse`)."""
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
    elif kernel == "mla":
        from benchmarks.kernels.bench_mla_decode import make_case, run

        heads, mode = name.split("/")
        run(make_case(int(heads), 64, 4096, 2048 if mode == "sparse" else None), "fp8", check)
    else:
        from kernels.dsa_indexer_triton import dsa_indexer_triton

        B, ctx, chunk = (64, 1024, 1) if "/decode/" in name else (1, 2048, 256)
        p = _paged(B, ctx, (D,), fp8)
        q = torch.randn(B * chunk, HI, D, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(B * chunk, HI, device="cuda")
        qs = torch.arange(B + 1, dtype=torch.int32, device="cuda") * chunk
        dsa_indexer_triton(q, w, p["k"], 0.1, qs, p["seq_lens"], p["table"], p["expected"], p["tags"], p["flags"],
                    D**-0.5, 2048, check_tags=check, config=name)  # fmt: skip
    torch.cuda.synchronize()
    return f"{kernel} {name} check={check} {time.perf_counter() - t0:.1f}s"


def tag_check_tasks() -> list[tuple[str, str, bool]]:
    """Both arms of every row the benchmarks' `--tag-check` runs time, the slowest compiles first."""
    from benchmarks.kernels.bench_mla_decode import TAG_CHECK_CASES as MLA_CASES
    from benchmarks.kernels.bench_paged_prefill import TAG_CHECK_EXTRA
    from kernels import dsa_indexer_triton as dsa
    from kernels import paged_decode_gqa as dec
    from kernels import paged_prefill_gqa as pre

    prefill = sorted(set(pre.DEFAULT_TILES.values()) | {t for _, t in TAG_CHECK_EXTRA})
    mla = [f"{h}/{'sparse' if topk else 'dense'}" for h, _, _, topk in MLA_CASES]
    dsa_fp8 = [dsa.DEFAULT_TILES[("fp8", kind)] for kind in ("decode", "prefill")]
    named = [
        ("prefill", prefill),
        ("mla", mla),
        ("decode", sorted(set(dec.DEFAULT_TILES.values()))),
        ("dsa", dsa_fp8),
    ]
    return [(kernel, n, check) for kernel, names in named for n in names for check in (True, False)]


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
    ap.add_argument("--tag-check", action="store_true", help="only the arms of the --tag-check rows")
    ap.add_argument("--only", default="", help="comma list of kernels to keep: prefill,mla,decode,dsa")
    args = ap.parse_args()
    t0 = time.perf_counter()
    todo = tag_check_tasks() if args.tag_check else tasks()
    if args.only:
        keep = set(args.only.split(","))
        todo = [t for t in todo if t[0] in keep]
    with ProcessPoolExecutor(args.jobs, mp_context=get_context("spawn")) as pool:
        for line in pool.map(warm, todo):
            print(line, flush=True)
    print(f"warm: {len(todo)} compiles in {time.perf_counter() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()

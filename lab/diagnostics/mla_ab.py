"""MLA decode, round 3 (issue 24): the committed kernel configuration against the new ones, BF16 and
FP8 latent caches, on the H200, in one call (~3-4 min). Run from the repo root:

    python3 -m lab.diagnostics.mla_ab [--rounds 3] [--heads 8,16,64] [--batches 1,8,64]
        [--contexts 4096,32768] [--budget-s 300] [--out $OUT/mla_ab.json]

Cases run batch 64 first, then 8, then 1 (long context first); none starts after `--budget-s`.
Per case (heads x batch x context, Kimi K2's 512 + 64 line, page 16, pages shuffled) and cache dtype:
`old` = the tiles of `benchmarks/results/kernels-h200.json` (2026-12-02) with that day's slice count
(`old_splits`); `new` = today's `TILES` entry with `pick_mla_splits`; then every `VARIANTS` entry of
the case's table key (the swapped dots, the shifted FP8 conversion, more CTAs an SM) with
`pick_mla_splits` for its `ctas_per_sm`. Each is one CUDA graph over as many copies of the batch
(distinct pages of one pool) as span 4x the L2, replayed in `--rounds` rounds, the variants in a
rotated order each round; a row's time is the median of its rounds, its spread their range. Every
variant's output is checked against the reference op on two sequences (rel. err < 1e-2, else it is
left out of the winners). The copy bandwidth is measured at the start and the end of the run.

The table printed last: per case, µs and fraction of copy for BF16 and FP8 (old, and the best new),
FP8 ÷ BF16 speed (old/old and best/best: the issue's goal is >= 1.8 at 8 and 16 heads, FP8 >= 0.85 of
copy), and TFLOP/s at 64 heads (goals: BF16 >= 400, FP8 >= 1.3x BF16); then per table key the
variants ranked by the geometric mean of time over `new` across the cases, and the `TILES` line to
paste for the winner.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
import triton

from benchmarks.kernels.bench_mla_decode import DR, FP8, PAGE, SOFTMAX_SCALE, R, label
from benchmarks.kernels.common import bench_ms, measure_ceilings, num_copies, rel_err, write_record
from kernels.mla_attention import mla_decode_ref
from kernels.mla_decode import mla_decode
from kernels.mla_tiles import TILES, VARIANTS, MlaTiles, pick_mla_splits, slice_cost_items, tile_rows
from kernels.split_k_merge import num_sms

# the decode tiles the committed H200 rows were measured with (kernels-h200.json, 2026-12-02)
OLD_TILES = {
    (64, False): MlaTiles(64, 32, 64, 8, 5, 1),
    (64, True): MlaTiles(64, 32, 64, 8, 5, 1),
    (16, False): MlaTiles(16, 64, 64, 4, 3, 2),
    (16, True): MlaTiles(16, 32, 64, 4, 5, 2),
}


def old_splits(num_tiles: int, head_blocks: int, max_items: int, ctas_per_sm: int) -> int:
    """2026-12-02's slice count: the fewest filling 85% of their waves' CTA slots, slices >= 512
    items, at most 64."""
    slots = num_sms(torch.device("cuda")) * ctas_per_sm
    base = max(num_tiles * head_blocks, 1)
    most = max(1, min(64, max_items // 512))
    for splits in range(1, most + 1):
        if base * splits >= 0.85 * triton.cdiv(base * splits, slots) * slots:
            return splits
    return most


def make_copies(H: int, B: int, ctx: int) -> dict[str, Any]:
    """One pool of shuffled pages (BF16 and its FP8 image) holding `copies` batches of B x ctx tokens,
    a page table and tags per copy, one q."""
    pages_per = ctx // PAGE
    copies = num_copies(B * ctx * (R + DR))  # FP8 bytes: the BF16 copies span twice as much
    P = copies * B * pages_per
    lines = torch.randn(P, PAGE, R + DR, device="cuda", dtype=torch.bfloat16)
    scale = float(lines.abs().amax()) / 448
    perm = torch.randperm(P, device="cuda").to(torch.int32)
    tags = torch.randint(0, 2**40, (P,), device="cuda")
    tables = [perm[i * B * pages_per : (i + 1) * B * pages_per].reshape(B, pages_per) for i in range(copies)]
    return dict(
        q=torch.randn(B, H, R + DR, device="cuda", dtype=torch.bfloat16), bf16=lines,
        fp8=(lines / scale).to(FP8), scale=scale, tables=tables, expected=[tags[t.long()] for t in tables],
        tags=tags, seq_lens=torch.full((B,), ctx, dtype=torch.int32, device="cuda"),
        flags=torch.zeros(B, dtype=torch.bool, device="cuda"),
    )  # fmt: skip


def variants(H: int, B: int, ctx: int, kv: str) -> list[tuple[str, MlaTiles, int]]:
    """(name, tiles, slices) to time: old, new, then the table key's VARIANTS."""
    fp8 = kv == "fp8"
    rows = tile_rows(H)
    line = (R + DR) * (1 if fp8 else 2)
    sms = num_sms(torch.device("cuda"))

    def new_splits(t: MlaTiles) -> int:
        cost = slice_cost_items(t.block_h, R, line)
        return pick_mla_splits(B, triton.cdiv(H, t.block_h), ctx, sms, t.ctas_per_sm, cost, t.block_n)

    old = OLD_TILES[(rows, fp8)]
    new = TILES[("decode", rows, fp8)]
    out = [("old", old, old_splits(B, triton.cdiv(H, old.block_h), ctx, old.ctas_per_sm))]
    out.append(("new", new, new_splits(new)))
    out += [(label(t), t, new_splits(t)) for t in VARIANTS.get(("decode", rows, fp8), [])]
    return out


def run(case: dict[str, Any], copy: int, kv: str, tiles: MlaTiles, splits: int) -> torch.Tensor:
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    return mla_decode(
        case["q"], cache, scale, R, case["seq_lens"], case["tables"][copy], case["expected"][copy],
        case["tags"], case["flags"], SOFTMAX_SCALE, num_splits=splits, tiles=tiles,
    )  # fmt: skip


def reference(case: dict[str, Any], kv: str, num: int = 2) -> torch.Tensor:
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    flags = torch.zeros(num, dtype=torch.bool, device="cuda")
    return mla_decode_ref(
        case["q"][:num].float(), cache, scale, R, case["seq_lens"][:num], case["tables"][0][:num],
        case["expected"][0][:num], case["tags"], flags, SOFTMAX_SCALE,
    )  # fmt: skip


def capture(case: dict[str, Any], kv: str, tiles: MlaTiles, splits: int) -> torch.cuda.CUDAGraph:
    """One graph calling the kernel on every copy (compiled and allocated outside the capture)."""
    n = len(case["tables"])
    for c in range(n):
        run(case, c, kv, tiles, splits)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for c in range(n):
            run(case, c, kv, tiles, splits)
    return graph


def ab_case(H: int, B: int, ctx: int, ceil: dict[str, float], rounds: int) -> list[dict[str, Any]]:
    case = make_copies(H, B, ctx)
    n = len(case["tables"])
    todo = [(kv, *v) for kv in ("bf16", "fp8") for v in variants(H, B, ctx, kv)]
    with ThreadPoolExecutor(8) as pool:  # compile side by side (Triton compiles outside the GIL)
        warm = [pool.submit(run, case, 0, kv, t, s) for kv, _, t, s in todo]
    graphs, errors = {}, {}
    refs = {kv: reference(case, kv) for kv in ("bf16", "fp8")}
    for (kv, name, t, s), w in zip(todo, warm, strict=True):
        try:
            out = w.result() if w.exception() is None else run(case, 0, kv, t, s)
            errors[(kv, name)] = rel_err(out[:2].float(), refs[kv])
            graphs[(kv, name)] = capture(case, kv, t, s)
        except Exception as exc:  # a config that does not compile or fit is reported, not fatal
            print(f"{kv} {name} failed: {type(exc).__name__}: ...{str(exc)[-500:]}", flush=True)
    assert not case["flags"].any(), "no page was reallocated: no sequence may be flagged"
    times: dict[tuple[str, str], list[float]] = {k: [] for k in graphs}
    keys = list(graphs)
    for r in range(rounds):  # alternate: every variant once a round, the order rotated
        for k in keys[r % len(keys) :] + keys[: r % len(keys)]:
            times[k].append(bench_ms(graphs[k].replay, warmup_ms=5, rep_ms=30) / n)
    rows = []
    for kv, name, t, s in todo:
        if (kv, name) not in times:
            continue
        ms = sorted(times[(kv, name)])[len(times[(kv, name)]) // 2]
        nbytes = B * ctx * (R + DR) * (1 if kv == "fp8" else 2)
        rows.append(
            {
                "kernel": "mla-decode", "case": f"heads={H} batch={B} context={ctx}", "heads": H,
                "batch": B, "context": ctx, "kv": kv, "variant": name, "tiles": label(t),
                "table_entry": ["decode", tile_rows(H), kv == "fp8"], "splits": s, "ms": ms,
                "spread": [min(times[(kv, name)]), max(times[(kv, name)])], "samples": times[(kv, name)],
                "GBps": nbytes / ms / 1e6, "fraction_of_copy": nbytes / ms / 1e6 / ceil["copy_GBps"],
                "TFLOPs": B * ctx * H * 2 * (R + DR + R) / ms / 1e9, "rel_err": errors[(kv, name)],
                "ok": errors[(kv, name)] < 1e-2,
            }
        )  # fmt: skip
    del graphs, case
    torch.cuda.empty_cache()
    return rows


def best(rows: list[dict[str, Any]], kv: str) -> dict[str, Any]:
    """The fastest correct row of a case for `kv` other than `old` (else `old`: nothing new passed), FP8
    dots left out (other numerics: `lab/diagnostics/mla_fp8_dot_ab.py` times them)."""
    new = [
        r for r in rows if r["kv"] == kv and r["ok"] and r["variant"] != "old" and "dot8" not in r["variant"]
    ]
    return min(new, key=lambda r: r["ms"]) if new else next(r for r in rows if r["kv"] == kv)


def summary(cases: list[list[dict[str, Any]]]) -> None:
    print(
        f"\n{'case':<28} | {'bf16 old':>15} {'bf16 best':>15} | {'fp8 old':>15} {'fp8 best':>15} | "
        f"{'fp8÷bf16 old':>12} {'best':>6} | TFLOP/s bf16/fp8 old -> best | best variants (bf16; fp8)"
    )
    for rows in cases:
        old = {r["kv"]: r for r in rows if r["variant"] == "old"}
        top = {kv: best(rows, kv) for kv in ("bf16", "fp8")}

        def cell(r: dict[str, Any]) -> str:
            return f"{r['ms'] * 1e3:7.1f}us {r['fraction_of_copy']:.2f}"

        flops = ""
        if rows[0]["heads"] == 64:
            flops = (
                f"{old['bf16']['TFLOPs']:.0f}/{old['fp8']['TFLOPs']:.0f} -> "
                f"{top['bf16']['TFLOPs']:.0f}/{top['fp8']['TFLOPs']:.0f}"
            )
        print(
            f"{rows[0]['case']:<28} | {cell(old['bf16']):>15} {cell(top['bf16']):>15} | {cell(old['fp8']):>15} "
            f"{cell(top['fp8']):>15} | {old['bf16']['ms'] / old['fp8']['ms']:12.2f} "
            f"{top['bf16']['ms'] / top['fp8']['ms']:6.2f} | {flops:<27} | {top['bf16']['variant']} "
            f"(x{top['bf16']['splits']}); {top['fp8']['variant']} (x{top['fp8']['splits']})",
            flush=True,
        )
    ratios: dict[tuple[Any, ...], dict[str, list[float]]] = {}
    for rows in cases:
        new = {r["kv"]: r["ms"] for r in rows if r["variant"] == "new"}
        for r in rows:
            if r["ok"]:
                per = ratios.setdefault(tuple(r["table_entry"]), {})
                per.setdefault(r["variant"], []).append(r["ms"] / new[r["kv"]])
    print("\nper table key, geometric mean of time / new across its cases (old: the 2026-12-02 kernel):")
    for key, per in ratios.items():
        full = {n: v for n, v in per.items() if len(v) == len(per["new"])}
        gm = {n: math.exp(sum(map(math.log, v)) / len(v)) for n, v in full.items()}
        ranked = sorted(gm.items(), key=lambda kv: kv[1])
        print(f"  {key}: " + "  ".join(f"{n} {g:.3f}" for n, g in ranked), flush=True)
        winner = next(n for n, _ in ranked if n != "old" and "dot8" not in n)
        if winner != "new":
            t = next(v for v in VARIANTS[key] if label(v) == winner)
            print(f"    paste into kernels.mla_tiles.TILES: {key}: {t},", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", default="8,16,64")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--contexts", default="4096,32768")
    ap.add_argument("--budget-s", type=float, default=300, help="no new case after this many seconds")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "/tmp"), "mla_ab.json"))
    args = ap.parse_args()
    start = time.monotonic()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    cases: list[list[dict[str, Any]]] = []
    todo = [
        (H, B, ctx)
        for B in sorted(map(int, args.batches.split(",")), reverse=True)  # the goals' batch 64 first
        for ctx in sorted(map(int, args.contexts.split(",")), reverse=True)
        for H in map(int, args.heads.split(","))
    ]
    for H, B, ctx in todo:
        if time.monotonic() - start > args.budget_s:
            print(f"budget spent: heads={H} batch={B} context={ctx} and later cases not timed", flush=True)
            break
        try:
            r = ab_case(H, B, ctx, ceil, args.rounds)
        except Exception as exc:  # out of memory, say: the other cases still run
            print(
                f"heads={H} batch={B} context={ctx} failed: {type(exc).__name__}: {str(exc)[-300:]}",
                flush=True,
            )
            torch.cuda.empty_cache()
            continue
        cases.append(r)
        print(
            f"timed {r[0]['case']}: " + " ".join(f"{x['kv']}:{x['variant']} {x['ms'] * 1e3:.1f}us" for x in r)
            + f"  [{time.monotonic() - start:.0f} s]",
            flush=True,
        )  # fmt: skip
        write_record(args.out, [x for c in cases for x in c], ceil, {"notes": "lab.diagnostics.mla_ab"})
    finish(ceil, lambda: summary(cases), start)


def finish(ceil: dict[str, float], summary: Callable[[], None], start: float) -> None:
    """The copy bandwidth at the start (`ceil`) and now, the summary, the run's duration."""
    end_copy = measure_ceilings()["copy_GBps"]
    print(
        f"copy bandwidth at the start {ceil['copy_GBps']:.0f} GB/s, at the end {end_copy:.0f} GB/s",
        flush=True,
    )
    summary()
    print(f"done in {time.monotonic() - start:.0f} s", flush=True)


if __name__ == "__main__":
    main()

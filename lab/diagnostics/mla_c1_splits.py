"""MLA decode at concurrency 1 (issue 24): the slice count `pick_mla_splits` chooses against a sweep,
on the H200, in one call (~1 min). Run from the repo root:

    python3 -m lab.diagnostics.mla_c1_splits [--contexts 2048,2176,8192] [--kv bf16,fp8] [--out $OUT/mla_c1_splits.json]

Why: one sequence, 64 heads (GLM 5.2 at one rank), is one 64-row head block, so the grid is
`(1, splits, 1)`. Until 2026-12-05 the cost model capped the slices at `items // slice_cost_items`
(each slice's fp32 partials, rows x 512 x 8 bytes, no more than its lines): at 2,048 tokens that was
7 programs with a BF16 cache and 3 with FP8, on 132 SMs, each walking 293 / 683 tokens in steps of
32 one after another; the c=1 profile (2026-12-04) had MLA at ~48 µs a layer for 2.3 MB of lines
(~50 GB/s). At that occupancy the step is latency-bound, and the partials (128 KB a slice) stay in
the L2 for the merge. The sweep of 2026-12-04 (lab/results/2026-12-04-r5/mla_c1_splits.log) re-fit
it: `kernels.mla_tiles.idle_splits` is the model now used where the tiles leave most SMs idle.

Per context and cache dtype, dense (the step within index_topk, as GLM-5 now runs it) and sparse
(2,048 chosen of the context, when longer): the launcher's own choice (`auto`), the one it made
before (`before`, timed as a fixed count) and each fixed slice count, timed as CUDA-graph replays
over copies of the case that span 4x the L2 (the engine streams ~0.5 GB of weights between two
layers' MLA, so the lines come from HBM), stage 1 and the merge together; each output checked
against the reference op (rel. err < 1e-2). The table gives µs per call, the best count's speed-up
over `auto` (1.00x: the chooser found it) and `auto`'s over `before`.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch

from benchmarks.kernels.bench_mla_decode import FP8, PAGE, SOFTMAX_SCALE, R, make_case
from benchmarks.kernels.common import graph_ms, num_copies, rel_err, write_record
from kernels.mla_attention import mla_decode_ref
from kernels.mla_decode import mla_decode
from kernels.mla_tiles import MAX_SPLITS, TILES, pick_mla_splits, slice_cost_items, tile_rows
from kernels.split_k_merge import num_sms

HEADS = 64
TOPK = 2048
SPLITS = (4, 7, 8, 12, 16, 24, 32, 48, 64, 96, 128)


def call(case: dict[str, Any], kv: str, splits: int | None) -> torch.Tensor:
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    return mla_decode(
        case["q"], cache, scale, R, case["seq_lens"], case["page_table"], case["expected_tags"],
        case["page_tags"], case["flags"], SOFTMAX_SCALE, case["topk"], num_splits=splits,
    )  # fmt: skip


def reference(case: dict[str, Any], kv: str) -> torch.Tensor:
    cache, scale = (case["bf16"], 1.0) if kv == "bf16" else (case["fp8"], case["scale"])
    return mla_decode_ref(
        case["q"].float(), cache, scale, R, case["seq_lens"], case["page_table"], case["expected_tags"],
        case["page_tags"], torch.zeros(1, dtype=torch.bool, device=case["q"].device), SOFTMAX_SCALE, case["topk"],
    )  # fmt: skip


def auto_splits(case: dict[str, Any], kv: str) -> int:
    """What the launcher picks for the case (as `launch_mla_paged` computes it)."""
    sparse = case["topk"] is not None
    tiles = TILES[("sparse" if sparse else "decode", tile_rows(HEADS), kv == "fp8")]
    items = case["topk"].shape[1] if sparse else case["page_table"].shape[1] * PAGE
    line = 576 * (1 if kv == "fp8" else 2)
    return pick_mla_splits(
        1, -(-HEADS // tiles.block_h), items, num_sms(case["q"].device), tiles.ctas_per_sm,
        slice_cost_items(tiles.block_h, R, line), tiles.block_n,
    )  # fmt: skip


def previous_splits(case: dict[str, Any], kv: str) -> int:
    """What the launcher picked before the idle model: `pick_mla_splits`' busy model at any grid (one
    tile here), each slice at least `slice_cost_items`."""
    sparse = case["topk"] is not None
    tiles = TILES[("sparse" if sparse else "decode", tile_rows(HEADS), kv == "fp8")]
    items = case["topk"].shape[1] if sparse else case["page_table"].shape[1] * PAGE
    slots = num_sms(case["q"].device) * tiles.ctas_per_sm
    cost = slice_cost_items(tiles.block_h, R, 576 * (1 if kv == "fp8" else 2))
    most = max(1, min(MAX_SPLITS, items // cost))
    return min(range(1, most + 1), key=lambda n: -(-n // slots) * (-(-items // n) + cost))


def sweep(ctx: int, topk: int | None, kv: str) -> dict[str, Any]:
    line_bytes = 576 * (1 if kv == "fp8" else 2)
    copies = [make_case(HEADS, 1, ctx, topk) for _ in range(num_copies(ctx * line_bytes))]
    for c in copies:  # one of the two caches is timed: drop the other's memory
        c.pop("fp8" if kv == "bf16" else "bf16")
    ref = reference(copies[0], kv)
    before = previous_splits(copies[0], kv)
    row: dict[str, Any] = {
        "context": ctx, "topk": topk, "kv": kv, "auto_splits": auto_splits(copies[0], kv),
        "before_splits": before,
    }  # fmt: skip
    times: dict[str, float] = {}
    for splits in (None, *sorted({*SPLITS, before})):
        name = "auto" if splits is None else str(splits)
        err = rel_err(call(copies[0], kv, splits).float(), ref)
        if err > 1e-2:
            print(f"  splits {name}: rel. err {err:.2e}, left out", flush=True)
            continue
        times[name] = 1e3 * graph_ms([lambda c=c, s=splits: call(c, kv, s) for c in copies])
    row["us"] = times
    best = min(times, key=times.__getitem__)
    row["best"] = best
    cells = "  ".join(f"{k}:{v:6.1f}" for k, v in times.items())
    print(
        f"ctx={ctx:6} {'sparse' if topk else 'dense '} {kv:4} auto={row['auto_splits']:3} "
        f"before={before:3}  {cells}  best {best} ({times['auto'] / times[best]:.2f}x auto); auto "
        f"{times.get(str(before), float('nan')) / times['auto']:.2f}x before",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="2048,2176,8192")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = []
    for ctx in (int(c) for c in args.contexts.split(",")):
        for kv in args.kv.split(","):
            rows.append(sweep(ctx, None, kv))  # dense: every key (GLM-5 within index_topk)
            if ctx > TOPK:
                rows.append(sweep(ctx, TOPK, kv))  # DSA: 2,048 chosen
    out = args.out or (os.path.join(os.environ["OUT"], "mla_c1_splits.json") if "OUT" in os.environ else None)
    if out:
        write_record(out, rows, {}, {"heads": HEADS, "batch": 1, "page_size": PAGE, "fp8": str(FP8)})


if __name__ == "__main__":
    main()

"""The DSA indexer's top-k selection on the GPU: the radix kernel (`top_positions_radix`) against
keys + `torch.topk` (`top_positions_keys`), the two paths of `kernels/selection_triton.py`, in one
run (issue 24: torch's one-block radix select, `sbtopk::gatherTopK`, was 0.366 ms of GLM 5.2's
3.58 ms decode step at concurrency 1, 37 µs a layer on a row of ~2,176 keys).

Cases, k = 2048 of L columns: one decode row at L = 2,176 (the profile's), 4,096 (a page table
wider than the sequence: -inf past 2,176) and 16,384 (RADIX_MAX_COLS); 64 decode rows at 8,192;
4,096 prefill rows at 8,192 (causal: row i sees 4,097 + i columns). Scores: normal, -inf where not
visible. Each case times the two paths in alternating pairs (CUDA-graph replays, `graph_ms`; odd
pairs time keys + topk first), `speedup` = the median of keys_ms / radix_ms over the pairs (> 1:
radix faster; decode's rows up to 8,192 columns take the resident-row kernel); `variants` times
the streamed radix kernel at other `block`s once each; `same_set` checks that both paths chose the
same positions. `fraction_of_ceiling`: the scores read once over the copy ceiling.

`--resident` times the radix path's two kernels instead, in alternating pairs on the same device:
the resident-row kernel (the row's keys loaded once into registers, `radix_resident`'s rows) against
the streamed one (the row re-read every round, `resident=False`) at 1 × 2,176, 1 × 4,096 (2,176
visible), 1 × 8,192 and 64 × 8,192; `speedup` = the median of streamed_ms / resident_ms (> 1:
resident faster), `same_out` = the two outputs equal column for column; and the resident kernel
with 8-bit digits (4 rounds of `tl.histogram`) against its 4-bit default, `digits8_speedup`.

    python3 -m benchmarks.kernels.bench_selection --out selection.json [--quick]   # H200, ~30 s
    python3 -m benchmarks.kernels.bench_selection --resident --out resident.json   # ~10 s
    python3 -m benchmarks.kernels.bench_selection --dry-run   # CPU: tiny cases in the interpreter
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch

if not torch.cuda.is_available():  # the CPU dry run: kernels in the interpreter (set before they load)
    os.environ.setdefault("TRITON_INTERPRET", "1")

from benchmarks.kernels.common import graph_ms, measure_ceilings, write_record  # noqa: E402
from kernels.selection_triton import (  # noqa: E402
    radix_block,
    radix_resident,
    top_positions_keys,
    top_positions_radix,
)

K = 2048
CASES = [  # (phase, rows, columns, visible columns of the first row)
    ("decode", 1, 2176, 2176),
    ("decode", 1, 4096, 2176),
    ("decode", 1, 16384, 16384),
    ("decode", 64, 8192, 8192),
    ("prefill", 4096, 8192, 4097),
]
RESIDENT_CASES = [
    ("decode", 1, 2176, 2176),
    ("decode", 1, 4096, 2176),
    ("decode", 1, 8192, 8192),
    ("decode", 64, 8192, 8192),
]
DRY_CASES = [("decode", 1, 300, 280), ("prefill", 5, 200, 196)]  # k = 64
VARIANT_BLOCKS = (512, 1024, 2048, 4096)  # beside the default (`radix_block`)
PAIRS, QUICK_PAIRS = 5, 3


def make_scores(phase: str, R: int, L: int, visible: int, dev: str) -> torch.Tensor:
    """[R, L] normal scores, -inf past each row's visible columns (prefill: one more a row)."""
    scores = torch.randn(R, L, device=dev)
    seen = visible + (torch.arange(R, device=dev)[:, None] if phase == "prefill" else 0)
    return scores.masked_fill(torch.arange(L, device=dev)[None, :] >= seen, float("-inf"))


def same_set(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.sort(dim=1).values, b.sort(dim=1).values)


def alternating(
    new: Callable[[], Any], old: Callable[[], Any], pairs: int, rep_ms: int
) -> tuple[list[float], list[float]]:
    """`pairs` graph timings of each, interleaved (odd pairs time `old` first: an order effect
    cancels instead of adding to one side)."""
    new_ms, old_ms = [], []
    for i in range(pairs):
        if i % 2:
            old_ms.append(graph_ms([old], rep_ms))
            new_ms.append(graph_ms([new], rep_ms))
        else:
            new_ms.append(graph_ms([new], rep_ms))
            old_ms.append(graph_ms([old], rep_ms))
    return new_ms, old_ms


def timed_row(
    kernel: str, case: tuple[str, int, int, int], new_ms: list[float], peer: str, old_ms: list[float],
    ceil: dict[str, float],
) -> dict[str, Any]:  # fmt: skip
    """The record row of `alternating`'s timings: the median, `peer`'s, and the median ratio old / new."""
    phase, R, L, visible = case
    ms = statistics.median(new_ms)
    return {
        "kernel": kernel,
        "case": f"{phase} rows={R} columns={L} visible={visible} k={K}",
        "goal": None,
        "ms": ms,
        "fraction_of_ceiling": R * L * 4 / ms / 1e6 / ceil["copy_GBps"],
        "peers": {peer: statistics.median(old_ms)},
        "speedup": statistics.median(o / n for o, n in zip(old_ms, new_ms, strict=True)),
    }


def bench_case(
    phase: str, R: int, L: int, visible: int, ceil: dict[str, float], pairs: int, rep_ms: int
) -> dict[str, Any]:
    scores = make_scores(phase, R, L, visible, "cuda")
    ok = same_set(top_positions_radix(scores, K), top_positions_keys(scores, K))
    radix_ms, keys_ms = alternating(
        lambda: top_positions_radix(scores, K), lambda: top_positions_keys(scores, K), pairs, rep_ms
    )
    variants = {
        f"block={b}": graph_ms([lambda b=b: top_positions_radix(scores, K, block=b)], rep_ms)
        for b in VARIANT_BLOCKS
        if b <= L and (radix_resident(R, L) or b != radix_block(R, L))  # resident: every block streamed
    }
    return {
        **timed_row("selection", (phase, R, L, visible), radix_ms, "keys_topk", keys_ms, ceil),
        "radix_ms": radix_ms,
        "keys_topk_ms": keys_ms,
        "variants": variants,
        "same_set": ok,
    }


def bench_resident_case(
    phase: str, R: int, L: int, visible: int, ceil: dict[str, float], pairs: int, rep_ms: int
) -> dict[str, Any]:
    """The resident-row kernel against the streamed one (its default `block`) on the same rows."""
    scores = make_scores(phase, R, L, visible, "cuda")
    resident = top_positions_radix(scores, K, resident=True)
    ok = torch.equal(resident, top_positions_radix(scores, K, resident=False))
    resident_ms, streamed_ms = alternating(
        lambda: top_positions_radix(scores, K, resident=True),
        lambda: top_positions_radix(scores, K, resident=False),
        pairs,
        rep_ms,
    )
    peer = f"streamed block={radix_block(R, L)}"
    # 8 bits a round (4 rounds of tl.histogram's 256 bins) against the default digits, same rows
    ok8 = torch.equal(top_positions_radix(scores, K, resident=True, digit_bits=8), resident)
    r8_ms, r4_ms = alternating(
        lambda: top_positions_radix(scores, K, resident=True, digit_bits=8),
        lambda: top_positions_radix(scores, K, resident=True, digit_bits=4),
        pairs,
        rep_ms,
    )
    return {
        **timed_row("selection resident", (phase, R, L, visible), resident_ms, peer, streamed_ms, ceil),
        "resident_ms": resident_ms,
        "streamed_ms": streamed_ms,
        "same_out": ok and same_set(resident, top_positions_keys(scores, K)),
        "digits8_ms": r8_ms,
        "digits4_ms": r4_ms,
        "digits8_speedup": statistics.median(o / n for o, n in zip(r4_ms, r8_ms, strict=True)),
        "digits8_same_out": ok8,
    }


def dry_run() -> list[dict[str, Any]]:
    """The tiny cases on the CPU (interpreter): both paths run and agree (the radix path's two
    kernels column for column); nothing is timed."""
    rows = []
    for phase, R, L, visible in DRY_CASES:
        scores = make_scores(phase, R, L, visible, "cpu")
        streamed = top_positions_radix(scores, 64, block=128)
        ok = same_set(streamed, top_positions_keys(scores, 64))
        ok = ok and torch.equal(top_positions_radix(scores, 64, resident=True), streamed)
        ok = ok and torch.equal(top_positions_radix(scores, 64, resident=True, digit_bits=8), streamed)
        rows.append({"kernel": "selection", "case": f"{phase} rows={R} columns={L} k=64", "same_set": ok})
        print(f"dry run {rows[-1]['case']}: same_set {ok}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="JSON record (required on the GPU)")
    ap.add_argument("--quick", action="store_true", help=f"{QUICK_PAIRS} pairs a case, shorter timings")
    ap.add_argument("--dry-run", action="store_true", help="the CPU check: tiny cases, no timing")
    ap.add_argument("--resident", action="store_true", help="resident-row kernel against streamed")
    args = ap.parse_args(argv)
    if args.dry_run:
        return dry_run()
    if not torch.cuda.is_available() or not args.out:
        sys.exit("needs a CUDA device and --out (on the CPU: --dry-run)")
    start = time.monotonic()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    pairs, rep_ms = (QUICK_PAIRS, 50) if args.quick else (PAIRS, 100)
    rows: list[dict[str, Any]] = []
    for case in RESIDENT_CASES if args.resident else CASES:
        if args.resident:
            rows.append(bench_resident_case(*case, ceil, pairs, rep_ms))
            r = rows[-1]
            ((peer, peer_ms),) = r["peers"].items()
            print(
                f"{r['case']:<52} resident {r['ms'] * 1e3:8.1f}us {peer} {peer_ms * 1e3:8.1f}us "
                f"speedup {r['speedup']:.2f}x same_out {r['same_out']} | 8-bit digits "
                f"{statistics.median(r['digits8_ms']) * 1e3:.1f}us vs 4-bit "
                f"{statistics.median(r['digits4_ms']) * 1e3:.1f}us: {r['digits8_speedup']:.2f}x "
                f"same_out {r['digits8_same_out']}",
                flush=True,
            )
            notes = "speedup: median over alternating pairs of streamed ms / resident ms"
        else:
            rows.append(bench_case(*case, ceil, pairs, rep_ms))
            r = rows[-1]
            variants = " ".join(f"{n} {t * 1e3:.1f}us" for n, t in r["variants"].items())
            print(
                f"{r['case']:<52} radix {r['ms'] * 1e3:8.1f}us keys+topk {r['peers']['keys_topk'] * 1e3:8.1f}us "
                f"speedup {r['speedup']:.2f}x same_set {r['same_set']} | {variants}",
                flush=True,
            )
            notes = "speedup: median over alternating pairs of keys+topk ms / radix ms"
        torch.cuda.empty_cache()
        write_record(args.out, rows, ceil, {"notes": notes})  # after every case: a timeout keeps what ran
    print(f"done in {time.monotonic() - start:.0f} s", flush=True)
    return rows


if __name__ == "__main__":
    main()

"""Shared pieces of the kernel benchmarks: ceilings measured in the same run, timing, the JSON record.

Timing is `triton.testing.do_bench(..., return_mode="median")` of a CUDA-graph replay that calls the
op once on each of enough input copies to exceed the L2 several times (an HBM number, not a cache
one), divided by the number of copies; the graph removes Python launch cost, as decode graphs do.
Record shape (issue 6): `{command, date, device, ceilings: {copy_GBps, bf16_TFLOPs, fp8_TFLOPs},
rows: [{kernel, case, goal, ms, fraction_of_ceiling, peers: {name: ms}, ...}]}`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import torch
import triton

L2_BYTES = 60 * 2**20  # H200; rotation sizes are chosen against this
TAG_CHECK_PAIRS = 9  # A/B pairs of a `--tag-check` run's rows (~0.4 s a pair)


def bench_ms(fn: Callable[[], Any], warmup_ms: int = 25, rep_ms: int = 100) -> float:
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def graph_ms(calls: list[Callable[[], Any]], rep_ms: int = 100) -> float:
    """Median time of one call, from CUDA-graph replays of all `calls` in turn (one per input copy).

    A graph takes the Python launch cost out, as the engine's decode graphs do, and each replay
    walks every copy once, so together they span more than the L2.
    """
    for call in calls:  # compile and allocate outside the capture
        call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return bench_ms(graph.replay, rep_ms=rep_ms) / len(calls)


def num_copies(bytes_per_copy: int, floor: int = 2) -> int:
    """Copies to rotate among so that together they span at least 4× the L2."""
    return max(floor, -(-4 * L2_BYTES // max(bytes_per_copy, 1)))


def rotating(fn: Callable[..., Any], copies: list[tuple[Any, ...]]) -> float:
    """Per-call time of `fn(*copy)` rotating over `copies`, timed as one graph replay of them all."""
    return graph_ms([lambda args=args: fn(*args) for args in copies])


def measure_ceilings() -> dict[str, float]:
    """Device-to-device copy (read + write counted), bf16 and fp8 8192³ products, on random data."""
    dev = "cuda"
    n = 2**30  # 1 GiB each way, 2 GiB moved
    src = torch.randn(n // 2, device=dev, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    copy_ms = bench_ms(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    mm_ms = bench_ms(lambda: a @ b)
    a8, b8 = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=dev)
    fp8_ms = bench_ms(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    flops = 2 * 8192**3
    return {
        "copy_GBps": 2 * n / copy_ms / 1e6,
        "bf16_TFLOPs": flops / mm_ms / 1e9,
        "fp8_TFLOPs": flops / fp8_ms / 1e9,
    }


def write_record(
    path: str, rows: list[dict[str, Any]], ceilings: dict[str, float], extra: dict[str, Any]
) -> None:
    record = {
        "command": " ".join(sys.argv),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "versions": {"torch": torch.__version__, "triton": triton.__version__},
        "ceilings": ceilings,
        "rows": rows,
        **extra,
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def tag_check_row(
    case: str, checked: Callable[[], Any], unchecked: Callable[[], Any], pairs: int, rep_ms: int = 100
) -> dict[str, Any]:
    """The `tag-check` row: `pairs` interleaved A/B timings of the same op with the check compiled in
    and out (clock drift hits both arms alike; odd pairs time the unchecked arm first, so an order
    effect cancels instead of adding to one side); the median relative difference and its spread,
    and each pair's two times (`on_ms`, `off_ms`)."""
    on, off = [], []
    for i in range(pairs):
        if i % 2:
            off.append(graph_ms([unchecked], rep_ms))
            on.append(graph_ms([checked], rep_ms))
        else:
            on.append(graph_ms([checked], rep_ms))
            off.append(graph_ms([unchecked], rep_ms))
    diffs = sorted((a - b) / b for a, b in zip(on, off, strict=True))
    return {
        "kernel": "tag-check",
        "case": case,
        "goal": "tag-check",
        "ms": statistics.median(on),
        "fraction_of_ceiling": None,
        "peers": {"check_off": statistics.median(off)},
        "overhead": statistics.median(diffs),
        "overhead_spread": [diffs[0], diffs[-1]],
        "pairs": pairs,
        "on_ms": on,
        "off_ms": off,
    }


def time_entries(
    names: list[str], op: Callable[[str], Any], error: Callable[[Any], float], rep_ms: int = 100
) -> tuple[dict[str, float], dict[str, float], dict[str, str]]:
    """(ms, error, failure) of `op(name)` per tile-table entry: one that fails on the device is reported
    and skipped, so one run still times the others."""
    times, errors, failed = {}, {}, {}
    for name in names:
        try:
            errors[name] = error(op(name))
            times[name] = graph_ms([lambda name=name: op(name)], rep_ms)
        except Exception as exc:  # noqa: BLE001 (reported in the record, not fatal)
            failed[name] = repr(exc)[:300]
            print(f"{name} failed: {failed[name]}", flush=True)
    return times, errors, failed


def tag_check_rows(
    ops: dict[str, Callable[[bool], Any]], pairs: int, rep_ms: int = 100
) -> list[dict[str, Any]]:
    """A `tag_check_row` per case: `ops[case](check)` runs the op with the check compiled in or out."""
    return [
        tag_check_row(case, lambda op=op: op(True), lambda op=op: op(False), pairs, rep_ms)
        for case, op in ops.items()
    ]


def overhead_text(row: dict[str, Any]) -> str:
    """`overhead +x.xx% [lo, hi]` of a tag-check row, for the printed table."""
    lo, hi = row["overhead_spread"]
    return f"overhead {row['overhead'] * 100:+.2f}% [{lo * 100:+.2f}, {hi * 100:+.2f}]"


def run_cases(
    bench_case: Callable[..., list[dict[str, Any]]],
    cases: list[tuple[Any, ...]],
    notes: str,
    quick_cases: list[tuple[Any, ...]] | None = None,
    tag_check_cases: list[tuple[Any, ...]] | None = None,
) -> tuple[list[dict[str, Any]], dict[str, float]]:
    """A benchmark's main: `--out PATH`; ceilings, then `bench_case(*case, ceilings)` per case, one record;
    returns (rows, ceilings). A benchmark that gives `quick_cases` takes `--quick` (those cases, shorter
    timings: one device call) and gets `bench_case(*case, ceilings, quick)`. One that gives
    `tag_check_cases` also takes `--tag-check [--pairs N]`: those cases' `tag-check` rows alone (no
    variants, peers or references), `bench_case(*case, ceilings, False, N)`, with the ceilings of the
    same run in the record as always."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--quick", action="store_true", help="the main cases only, shorter timings (one device call)"
    )
    if tag_check_cases is not None:
        ap.add_argument("--tag-check", action="store_true", help="only the tag check's A/B rows")
        ap.add_argument("--pairs", type=int, default=TAG_CHECK_PAIRS, help="A/B pairs per tag-check row")
    args = ap.parse_args()
    torch.manual_seed(0)
    ceil = measure_ceilings()
    print("ceilings", ceil, flush=True)
    rows: list[dict[str, Any]] = []
    quick = (args.quick,) if quick_cases is not None else ()
    todo = quick_cases if args.quick and quick_cases else cases
    if getattr(args, "tag_check", False):
        todo, quick = tag_check_cases or [], (False, args.pairs)
        notes += f"; --tag-check: interleaved A/B pairs only ({args.pairs} per row)"
    for case in todo:
        rows += bench_case(*case, ceil, *quick)
        torch.cuda.empty_cache()
        write_record(args.out, rows, ceil, {"notes": notes})  # after every case: a timeout keeps what ran
    return rows, ceil

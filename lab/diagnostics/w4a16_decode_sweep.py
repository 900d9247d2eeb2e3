"""Issue 24, W4A16 at decode (M = 1, 2): the old GEMV against the TMA-streamed GEMV and the
register-prefetch variant, on the benchmark's matrices and the GLM 5.2 decode step's, in one H200 call.

Every candidate is checked against the fp32 torch reference first (a failing candidate is reported and
left out), then timed in `REPEATS` rounds whose order alternates (A B ... B A: clock drift and order
effects hit old and new alike). Peers in the same run: FP8 `torch._scaled_mm` (M padded to 16), cuBLAS
bf16, and the copy bandwidth at the start and the end. Bytes = packed words + bf16 scales + activations
and output; fraction of copy = bytes / median time / copy. Prints each case's table as it ends (µs per
candidate, so the launcher's table can be set from it), then per candidate the total over the GLM
decode matrices and the mean time over the best over all cases; writes `--out` (JSON).

    python3 -m lab.diagnostics.w4a16_decode_sweep --out w4a16_decode.json [--budget-s 150]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.kernels.common import graph_ms, measure_ceilings, num_copies, rel_err
from kernels.w4a16_config import (
    GEMV_DEFAULT,
    GEMV_NARROW,
    TMA_PROGRAMS_PER_SM,
    W4A16Config,
    pick_config,
    with_split_k,
)
from kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref

DEV = "cuda"  # a CPU smoke run of this script's logic (TRITON_INTERPRET=1, tiny shapes) sets "cpu"
ACT = torch.bfloat16  # activations (the smoke run: float16, which the interpreter's tl.dot computes)
REPEATS = 4  # A B .. B A B A ..: old and new each timed first twice
REP_MS = 40
OLD = (W4A16Config(0, 128, 256), 12)  # the launcher's GEMV before issue 24's round 6, at 12 programs/SM
# (from M = 3 the launcher's tiles are unchanged: "old (launcher before)" is its pick there)
# name, N, K, group: the benchmark's rows and one GLM 5.2 layer's decode products at c=1 (g=32)
SHAPES = [  # most wanted first (`--budget-s` cuts the tail): the goal row, one GLM layer, the rest
    ("dense", 8192, 8192, 128),
    ("glm o_proj", 6144, 16384, 32),
    ("glm q_b", 16384, 2048, 32),
    ("glm q_a", 2048, 6144, 32),
    ("glm kv_a", 576, 6144, 32),
    ("glm shared gate", 2048, 6144, 32),
    ("glm shared down", 6144, 2048, 32),
    ("dense", 8192, 8192, 32),
    ("kimi-expert-gate-up", 4096, 7168, 32),
    ("kimi-expert-down", 7168, 2048, 32),
]
M2_SHAPES = {("dense", 8192, 8192, 32)}  # also at M = 2 (speculative decoding verifies two tokens)
CANDIDATES: dict[str, tuple[W4A16Config, int]] = {  # label -> (config, programs per SM its split aims at)
    "tma 128x256 s3 4/SM": (W4A16Config(0, 128, 256, tma_stages=3), 4),
    "tma 128x256 s4 2/SM": (W4A16Config(0, 128, 256, tma_stages=4), 2),
    "tma 128x256 s4 8/SM": (W4A16Config(0, 128, 256, tma_stages=4), 8),
    "tma 128x256 s6 2/SM": (W4A16Config(0, 128, 256, tma_stages=6), 2),
    "tma 64x256 s4 8/SM": (W4A16Config(0, 64, 256, tma_stages=4), 8),
    "tma 256x256 w8 s3 4/SM": (W4A16Config(0, 256, 256, num_warps=8, tma_stages=3), 4),
    "prefetch 128x256 8/SM": (W4A16Config(0, 128, 256, prefetch=True), 8),
    "prefetch 64x256 12/SM": (W4A16Config(0, 64, 256, prefetch=True), 12),
}
M2_CANDIDATES = {  # at M = 2 only: a program a row (the launcher runs both rows against one stream)
    "tma 128x256 s4 4/SM a row each": (W4A16Config(0, 128, 256, tma_stages=4), 4),
}
M16_SHAPES = [("dense", 8192, 8192, 128), ("glm o_proj", 6144, 16384, 32)]  # the tiles at M = 16 (stretch)
TILE_CANDIDATES = {  # M = 16: the transposed tile (dequantized w as wgmma's register operand)
    "swap bm16 64x128 w4": (W4A16Config(16, 64, 128, num_stages=4, swap_xw=True), 4),
    "swap bm16 128x128 w8": (W4A16Config(16, 128, 128, num_warps=8, num_stages=4, swap_xw=True), 4),
    "swap bm16 64x256 w4 st3": (W4A16Config(16, 64, 256, num_stages=3, swap_xw=True), 4),
    "swap bm16 64x128 w4 8/SM": (W4A16Config(16, 64, 128, num_stages=4, swap_xw=True), 8),
}
PEER_FP8 = "peer: scaled_mm fp8 (M padded to 16)"
PEER_BF16 = "peer: cublas bf16"


def alternating(calls: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """`REPEATS` rounds of every timing, forward in even rounds and backward in odd ones."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(REPEATS):
        for name in names if r % 2 == 0 else names[::-1]:
            times[name].append(calls[name]())
    return times


def case_rows(name: str, M: int, N: int, K: int, group: int, copy: float, sms: int) -> list[dict[str, Any]]:
    nbytes = N * K // 2 + N * (K // group) * 2 + 2 * M * K + 2 * M * N
    copies = []
    for _ in range(num_copies(nbytes)):
        packed = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), dtype=torch.int32, device=DEV)
        scale = (torch.rand(N, K // group, device=DEV) * 0.02 + 0.002).to(torch.bfloat16)
        copies.append((packed, scale))
    x = torch.randn(M, K, device=DEV).to(ACT)
    ref = w4a16_gemm_ref(x.float(), copies[0][0], copies[0][1].float())
    if M <= 2:  # the GEMVs
        trials = {**CANDIDATES, **(M2_CANDIDATES if M == 2 else {})}
        cands = {
            "old (launcher before)": with_split_k(OLD[0], M, N, K, sms, OLD[1]),
            "new (launcher)": pick_config(M, N, K, sms, group),
        }
    else:  # the tiles: the launcher's pick is unchanged
        trials, cands = TILE_CANDIDATES, {"old (launcher before)": pick_config(M, N, K, sms, group)}
    cands |= {label: with_split_k(cfg, M, N, K, sms, per_sm) for label, (cfg, per_sm) in trials.items()}
    errs: dict[str, float] = {}
    calls: dict[str, Callable[[], float]] = {}
    for label, cfg in cands.items():
        try:
            out = torch.full((M, N), float("nan"), device=DEV, dtype=ACT)  # poisoned
            w4a16_gemm(x, *copies[0], group, config=cfg, out=out)
            errs[label] = rel_err(out.float(), ref)
        except Exception as exc:  # noqa: BLE001 (a candidate that fails is a result, not the end of the run)
            print(f"  {label}: {repr(exc)[:300]}\n{traceback.format_exc()[-1500:]}", flush=True)
            continue
        if not errs[label] < 1e-2:
            print(f"  {label}: rel_err {errs[label]:.2e}: wrong, not timed", flush=True)
            continue
        calls[label] = lambda cfg=cfg: graph_ms(
            [lambda w=w, s=s: w4a16_gemm(x, w, s, group, config=cfg) for w, s in copies], REP_MS
        )
    one = torch.ones((), device=DEV)
    fp8 = [torch.randn(N, K, device=DEV).to(torch.float8_e4m3fn).t() for _ in range(num_copies(N * K))]
    x8 = torch.randn(-(-M // 16) * 16, K, device=DEV).to(torch.float8_e4m3fn)
    calls[PEER_FP8] = lambda: graph_ms(
        [
            lambda b=b: torch._scaled_mm(x8, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            for b in fp8
        ],
        REP_MS,
    )
    bf16 = [torch.randn(N, K, device=DEV, dtype=ACT) for _ in range(num_copies(2 * N * K))]
    calls[PEER_BF16] = lambda: graph_ms([lambda w=w: x @ w.t() for w in bf16], REP_MS)
    peer_bytes = {PEER_FP8: N * K + x8.numel() + 2 * x8.shape[0] * N, PEER_BF16: 2 * N * K + 2 * M * (K + N)}
    case = f"M={M} N={N} K={K} g={group} {name}"
    rows = []
    for label, ts in alternating(calls).items():
        med = statistics.median(ts)
        b = peer_bytes.get(label, nbytes)
        cfg = cands.get(label)
        rows.append(
            {
                "case": case, "candidate": label, "ms": med, "samples_ms": ts,
                "spread": (max(ts) - min(ts)) / med, "GBps": b / med / 1e6,
                "copy_fraction": b / med / 1e6 / copy,
                "rel_err": errs.get(label, float("nan")), "config": asdict(cfg) if cfg else None,
            }
        )  # fmt: skip
    return rows


def print_case(rows: list[dict[str, Any]]) -> None:
    ours = [r for r in rows if not r["candidate"].startswith("peer")]
    if not ours:
        print(f"{rows[0]['case']:<44} => no candidate passed its check\n", flush=True)
        return
    best = min(ours, key=lambda r: r["ms"])
    by = {r["candidate"]: r for r in rows}
    for r in rows:
        mark = " <- best" if r is best else ""
        print(
            f"{r['case']:<44} {r['candidate']:<36} {r['ms'] * 1e3:7.1f}us {r['spread']:6.1%} "
            f"{r['GBps']:6.0f} {r['copy_fraction']:5.2f} {r['rel_err']:8.1e}{mark}"
        )
    old, fp8 = by.get("old (launcher before)", best), by[PEER_FP8]
    new = by.get("new (launcher)", old)
    print(
        f"{rows[0]['case']:<44} => new {new['ms'] * 1e3:.1f}us = {old['ms'] / new['ms']:.2f}x old, "
        f"{new['copy_fraction']:.2f} of copy, {fp8['ms'] / new['ms']:.2f}x fp8; best {best['candidate']} "
        f"{best['ms'] * 1e3:.1f}us = {old['ms'] / best['ms']:.2f}x old, {fp8['ms'] / best['ms']:.2f}x fp8\n",
        flush=True,
    )


def summary(rows: list[dict[str, Any]]) -> None:
    """Per GEMV candidate: total µs over the GLM decode matrices at M=1 (what the c=1 step pays, per
    layer) and the mean of time / best time over the M = 1, 2 cases (the launcher's one table entry)."""
    rows = [r for r in rows if r["case"].startswith(("M=1 ", "M=2 "))]  # the GEMV's table
    cases = list(dict.fromkeys(r["case"] for r in rows))
    ours = [r for r in rows if not r["candidate"].startswith("peer")]
    best = {c: min(r["ms"] for r in ours if r["case"] == c) for c in cases}
    labels = list(dict.fromkeys(r["candidate"] for r in rows))
    print(f"{'candidate':<36} {'GLM layer us':>12} {'mean/best':>9} cases")
    for label in labels:
        mine = [r for r in rows if r["candidate"] == label]
        glm = sum(r["ms"] for r in mine if " glm " in r["case"] and r["case"].startswith("M=1 ")) * 1e3
        rel = statistics.mean(r["ms"] / best[r["case"]] for r in mine)
        print(f"{label:<36} {glm:12.1f} {rel:9.3f} {len(mine)}/{len(cases)}")
    print(
        f"-> GEMV_DEFAULT (now {GEMV_DEFAULT}), GEMV_NARROW (now {GEMV_NARROW}), "
        f"TMA_PROGRAMS_PER_SM (now {TMA_PROGRAMS_PER_SM}) in "
        "kernels/w4a16_gemm.py: the candidate with the least GLM layer time and mean/best"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "w4a16_decode.json"))
    ap.add_argument("--budget-s", type=float, default=150.0, help="no new case starts past this")
    args = ap.parse_args()
    torch.manual_seed(0)
    start = time.time()
    ceil0 = measure_ceilings()
    copy = ceil0["copy_GBps"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"copy {copy:.0f} GB/s, {sms} SMs; new GEMV_DEFAULT {GEMV_DEFAULT}", flush=True)
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(), "copy_GBps": [copy], "ceilings": ceil0,
        "command": "python3 -m lab.diagnostics.w4a16_decode_sweep", "repeats": REPEATS, "rep_ms": REP_MS,
    }  # fmt: skip
    rows: list[dict[str, Any]] = []
    ones = [(1, s) for s in SHAPES]  # M = 2 and the M = 16 goal row early, before the budget can cut them
    todo = ones[:4] + [(2, s) for s in SHAPES if s in M2_SHAPES] + [(16, M16_SHAPES[0])] + ones[4:]
    todo += [(16, s) for s in M16_SHAPES[1:]]
    for M, (name, N, K, group) in todo:
        if time.time() - start > args.budget_s:
            print(f"budget: skipped M={M} {name} {N}x{K} g{group}", flush=True)
            continue
        new = case_rows(name, M, N, K, group, copy, sms)
        torch.cuda.empty_cache()  # the case's weight copies and peers are gone
        rows += new
        print_case(new)
        with open(args.out, "w") as f:  # a timeout keeps what ran
            json.dump({**record, "rows": rows}, f, indent=1)
    record["copy_GBps"].append(measure_ceilings()["copy_GBps"])
    print(f"copy at the end {record['copy_GBps'][1]:.0f} GB/s (start {copy:.0f}); {time.time() - start:.0f}s")
    with open(args.out, "w") as f:
        json.dump({**record, "rows": rows}, f, indent=1)
    summary(rows)


if __name__ == "__main__":
    main()

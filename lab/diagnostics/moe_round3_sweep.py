"""Round-3 sweep for issue 24's INT4 decode rows: the fused MoE GEMV at M = 1, 8, 16, 64 (Kimi K2 and
GLM-5 geometries) and the W4A16 GEMV at M = 1 on >= 16 MB matrices, old configs against new ones
(the pipelined K loop, `loop_stages`, at fewer and longer programs per SM; the grouped GEMV from
M = 16), in one H200 call.

Every candidate is checked against the fp32 torch reference, then timed in `REPEATS` rounds; within a
round the candidates alternate (clock drift and thermals hit them all alike). Copy bandwidth is
measured at the start and the end of the same run; fraction of copy = bytes / median time / copy,
bytes = the touched experts' packed words and bf16 scales (each read once) plus activations (MoE),
or the matrix's words, scales and activations (W4A16). Prints a compact table and each case's
winner; writes `$OUT/moe_round3.json`.

    python3 -m lab.diagnostics.moe_round3_sweep [--quick]    # ~3 min on the H200 (--quick: M=1 only)
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

from benchmarks.kernels.bench_fused_moe import G, Shape
from benchmarks.kernels.common import graph_ms, measure_ceilings, num_copies, rel_err
from kernels.formats.int4 import repack_int4
from kernels.fused_moe import MoEConfig, fused_moe, fused_moe_ref, pick_moe_config
from kernels.w4a16_config import GEMV_PROGRAMS_PER_SM, W4A16Config, pick_config, with_split_k
from kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref

DEV = "cuda"  # a CPU smoke run (TRITON_INTERPRET=1, tiny shapes) sets "cpu"
REPEATS = 3
REP_MS = 60  # do_bench's timing window per measurement (x REPEATS, alternating)
ACT = torch.bfloat16  # activations (the smoke run: float32, which the interpreter computes exactly)
ROUTINGS = 4  # routings per graph replay: up to 32 experts at M=1 (Kimi 0.8 GB, >> L2)
SHAPES = [
    Shape("kimi-k2", 384, 7168, 2048, 8, (1, 8, 16, 64)),
    Shape("glm-5", 256, 6144, 2048, 8, (1, 8, 16, 64)),
]
MOE_CANDIDATES = {  # label -> config; "old" is the launcher's pick before this round
    "gemv 64x256 s3 4/SM": MoEConfig(0, 64, 256, loop_stages=3, programs_per_sm=4),
    "gemv 64x256 s4 4/SM": MoEConfig(0, 64, 256, loop_stages=4, programs_per_sm=4),
    "gemv 64x256 s3 8/SM": MoEConfig(0, 64, 256, loop_stages=3, programs_per_sm=8),
    "gemv 64x256 s3 12/SM": MoEConfig(0, 64, 256, loop_stages=3),
    "gemv 128x256 w8 s3 4/SM": MoEConfig(0, 128, 256, num_warps=8, loop_stages=3, programs_per_sm=4),
    "gemv 64x256 s3 4/SM lift": MoEConfig(0, 64, 256, loop_stages=3, programs_per_sm=4, lift=True),
}
MOE_SORTED = {  # from M = 8: one pair a program in moe_align's expert order (blocks of one pair), so
    # the pairs of one expert run side by side and all but the first read its words from L2 (by pair
    # id, they are far apart: at M=64 the GEMV reads 512 experts' bytes for 285 touched)
    "sorted1 64x256": MoEConfig(1, 64, 256, lift=True, grouped=True),
    "sorted1 64x256 s3 4/SM": MoEConfig(
        1, 64, 256, lift=True, grouped=True, loop_stages=3, programs_per_sm=4
    ),
}
MOE_GROUPED = {  # from M = 16 (two pairs of one expert begin to meet)
    "grouped2 32x256": MoEConfig(2, 32, 256, lift=True, grouped=True),
    "grouped2 32x256 s3": MoEConfig(2, 32, 256, lift=True, grouped=True, loop_stages=3),
}
W4A16_SHAPES = [(8192, 8192, 32), (8192, 8192, 128), (28672, 8192, 32)]  # N, K, group: 37.7, 35.7, 132 MB
W4A16_CANDIDATES = {  # label -> (config, programs per SM its split aims for)
    "gemv 128x256 s3 4/SM": (W4A16Config(0, 128, 256, loop_stages=3), 4),
    "gemv 128x256 s4 4/SM": (W4A16Config(0, 128, 256, loop_stages=4), 4),
    "gemv 128x256 s3 8/SM": (W4A16Config(0, 128, 256, loop_stages=3), 8),
    "gemv 64x256 s3 8/SM": (W4A16Config(0, 64, 256, loop_stages=3), 8),
    "gemv 256x256 w8 s3 4/SM": (W4A16Config(0, 256, 256, num_warps=8, loop_stages=3), 4),
}


def make_experts(shape: Shape) -> tuple[torch.Tensor, ...]:
    """Random words (every nibble value) and bf16 scales sized so activations stay O(1)."""
    E, H, I = shape.num_experts, shape.hidden, shape.inter
    w13 = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device=DEV)
    s13 = (torch.rand(E, 2 * I, H // G, device=DEV) * 0.004 + 0.001).bfloat16()
    w2 = torch.randint(-(2**31), 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device=DEV)
    s2 = (torch.rand(E, H, I // G, device=DEV) * 0.004 + 0.001).bfloat16()
    return w13, s13, w2, s2


def routing(shape: Shape, M: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(x [M, H] bf16, ids [M, k] distinct experts per token, weights [M, k] fp32)."""
    x = torch.randn(M, shape.hidden, device=DEV).to(ACT)
    ids = torch.rand(M, shape.num_experts, device=DEV).topk(shape.top_k, dim=-1).indices
    return x, ids, torch.rand(M, shape.top_k, device=DEV) + 0.1


def rounds(calls: dict[str, Callable[[], float]]) -> dict[str, list[float]]:
    """`REPEATS` rounds of every timing, in turn within a round (round r starts at candidate r)."""
    names = list(calls)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(REPEATS):
        for i in range(len(names)):
            name = names[(i + r) % len(names)]
            times[name].append(calls[name]())
    return times


def row(
    case: str, name: str, ts: list[float], nbytes: float, copy: float, err: float, cfg: Any
) -> dict[str, Any]:
    med = statistics.median(ts)
    return {
        "case": case, "candidate": name, "ms": med, "samples_ms": ts, "spread": (max(ts) - min(ts)) / med,
        "GBps": nbytes / med / 1e6, "copy_fraction": nbytes / med / 1e6 / copy, "rel_err": err,
        "config": asdict(cfg) if cfg is not None else None,
    }  # fmt: skip


def moe_case(shape: Shape, M: int, experts: tuple[torch.Tensor, ...], copy: float) -> list[dict[str, Any]]:
    sets = [routing(shape, M) for _ in range(ROUTINGS)]
    x0, ids0, wts0 = sets[0]
    ref = fused_moe_ref(x0.float(), ids0, wts0, *experts, G)
    old = pick_moe_config(M * shape.top_k, shape.num_experts)
    cands = {
        "old (launcher)": old, **MOE_CANDIDATES, **(MOE_SORTED if M >= 8 else {}), **(MOE_GROUPED if M >= 16 else {})
    }  # fmt: skip
    errs, calls = {}, {}
    for name, cfg in cands.items():
        try:
            errs[name] = rel_err(fused_moe(x0, ids0, wts0, *experts, G, config=cfg).float(), ref)
        except Exception as exc:  # a candidate that fails to compile is a result, not the end of the run
            print(f"  {name}: {repr(exc)[:200]}\n{traceback.format_exc()[-1500:]}", flush=True)
            continue

        def run(cfg: MoEConfig = cfg) -> float:
            return graph_ms(
                [lambda s=s: fused_moe(s[0], s[1], s[2], *experts, G, config=cfg) for s in sets], REP_MS
            )

        calls[name] = run
    touched = sum(len(torch.unique(s[1])) for s in sets) / len(sets)
    nbytes = touched * shape.expert_bytes + 2 * M * shape.hidden * 2
    case = f"moe {shape.name} M={M}"
    return [row(case, n, ts, nbytes, copy, errs[n], cands[n]) for n, ts in rounds(calls).items()]


def w4a16_case(N: int, K: int, group: int, copy: float, sms: int) -> list[dict[str, Any]]:
    nbytes = N * K // 2 + N * (K // group) * 2 + 2 * K + 2 * N
    copies = []
    for _ in range(num_copies(nbytes)):
        packed = torch.randint(-(2**31), 2**31 - 1, (N, K // 8), dtype=torch.int32, device=DEV)
        scale = (torch.rand(N, K // group, device=DEV) * 0.02 + 0.002).to(torch.bfloat16)
        copies.append(repack_int4(packed, scale)[:2])
    x = torch.randn(1, K, device=DEV).to(ACT)
    ref = w4a16_gemm_ref(x.float(), copies[0][0], copies[0][1].float())
    cands = {"old (launcher)": pick_config(1, N, K, sms, group)}
    for name, (cfg, per_sm) in W4A16_CANDIDATES.items():
        cands[name] = with_split_k(cfg, 1, N, K, sms, per_sm)
    errs, calls = {}, {}
    for name, cfg in cands.items():
        errs[name] = rel_err(w4a16_gemm(x, *copies[0], group, config=cfg).float(), ref)

        def run(cfg: W4A16Config = cfg) -> float:
            return graph_ms(
                [lambda w=w, s=s: w4a16_gemm(x, w, s, group, config=cfg) for w, s in copies], REP_MS
            )

        calls[name] = run
    fp8 = [torch.randn(N, K, device=DEV).to(torch.float8_e4m3fn).t() for _ in range(num_copies(N * K))]
    x8 = torch.randn(16, K, device=DEV).to(torch.float8_e4m3fn)
    one = torch.ones((), device=DEV)
    calls["peer: scaled_mm fp8 (M padded to 16)"] = lambda: graph_ms(
        [
            lambda b=b: torch._scaled_mm(x8, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
            for b in fp8
        ],
        REP_MS,
    )
    errs["peer: scaled_mm fp8 (M padded to 16)"] = float("nan")
    case = f"w4a16 M=1 N={N} K={K} g={group}"
    out = []
    for n, ts in rounds(calls).items():
        out.append(row(case, n, ts, nbytes, copy, errs[n], cands.get(n)))
        if n.startswith("peer"):  # the FP8 matrix's bytes, for its own fraction of copy
            out[-1]["copy_fraction"] = (N * K + 2 * 16 * K) / out[-1]["ms"] / 1e6 / copy
    return out


HEADER = f"{'case':<34} {'candidate':<36} {'us':>8} {'spread':>6} {'GB/s':>6} {'copy':>5} {'err':>8}"


def table(rows: list[dict[str, Any]]) -> None:
    """Each case's candidates and its winner (printed as each case ends), then the MoE summary."""
    for case in dict.fromkeys(r["case"] for r in rows):
        same = [r for r in rows if r["case"] == case]
        ours = [r for r in same if not r["candidate"].startswith("peer")]
        best = min(ours, key=lambda r: r["ms"])
        old = next((r for r in same if r["candidate"].startswith("old")), best)
        for r in same:
            mark = " <- best" if r is best else ""
            print(
                f"{case:<34} {r['candidate']:<36} {r['ms'] * 1e3:8.1f} {r['spread']:6.1%} {r['GBps']:6.0f} "
                f"{r['copy_fraction']:5.2f} {r['rel_err']:8.1e}{mark}"
            )
        print(
            f"{case:<34} => best {best['candidate']}: {old['ms'] / best['ms']:.2f}x the old, {best['copy_fraction']:.2f} of copy\n"
        )


def moe_summary(rows: list[dict[str, Any]]) -> None:
    totals: dict[str, float] = {}
    for r in rows:
        if r["case"].startswith("moe"):
            totals[r["candidate"]] = totals.get(r["candidate"], 0.0) + r["ms"] / min(
                q["ms"] for q in rows if q["case"] == r["case"]
            )
    n = len({r["case"] for r in rows if r["case"].startswith("moe")})
    moe = [r for r in rows if r["case"].startswith("moe")]
    full = {k: v / n for k, v in totals.items() if sum(1 for r in moe if r["candidate"] == k) == n}
    if full:
        print("MoE, mean time over the best of each case (candidates run at every M):")
        for k, v in sorted(full.items(), key=lambda kv: kv[1]):
            print(f"  {v:5.3f}  {k}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="M=1 only")
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "moe_round3.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    start = time.time()
    ceil0 = measure_ceilings()
    copy = ceil0["copy_GBps"]
    print(f"copy {copy:.0f} GB/s (GEMV_PROGRAMS_PER_SM was {GEMV_PROGRAMS_PER_SM})\n{HEADER}", flush=True)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    record: dict[str, Any] = {"device": torch.cuda.get_device_name(), "copy_GBps": [copy], "ceilings": ceil0}
    rows: list[dict[str, Any]] = []

    def save(done: str, new: list[dict[str, Any]] = ()) -> None:  # a timeout keeps what ran
        table(list(new))
        print(f"{done} done at {time.time() - start:.0f}s\n", flush=True)
        with open(args.out, "w") as f:
            json.dump({**record, "rows": rows}, f, indent=1)

    for N, K, group in W4A16_SHAPES:
        new = w4a16_case(N, K, group, copy, sms)
        rows += new
        save(f"w4a16 {N}x{K} g{group}", new)
        torch.cuda.empty_cache()
    for shape in SHAPES:
        experts = make_experts(shape)
        for M in (1,) if args.quick else shape.ms:
            new = moe_case(shape, M, experts, copy)
            rows += new
            save(f"moe {shape.name} M={M}", new)
        del experts
        torch.cuda.empty_cache()
    record["copy_GBps"].append(measure_ceilings()["copy_GBps"])
    save(f"copy at the end {record['copy_GBps'][1]:.0f} GB/s (start {copy:.0f})")
    moe_summary(rows)


if __name__ == "__main__":
    main()

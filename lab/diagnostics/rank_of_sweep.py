"""Issue 24, GLM 5.2 rank 0 of 8 at c=1: the W4A16 GEMV and the fused INT4 MoE GEMV on the exact
per-rank shapes of one decode layer, under the launchers' configs and alternatives, in one GPU call.

The shapes are what `build_random_model(make_geometry("glm-5.2", 2, rank_of=8), "int4-all")` builds
(a dense layer and a MoE layer, projections fused as after a load): every `Int4Linear` (N, K, group,
out dtype; equal ones merged) with its calls in a 78-layer step, and the layer's `QuantExperts` (32 of
256 experts local). The rank-of-8 profile (lab/results/2026-12-05-r12/prof-r8.json) puts 3.5 ms of the
step in 546 GEMV calls and 1.8 ms in 150 fused-MoE kernels; this says which configs would cut that.

Each case: every candidate is run once and checked against the launcher's config's output (and the
fp32 reference): rel. error to the launcher's output within bf16 rounding (`MATCH`), else reported and
not timed. Then `REPEATS` alternating rounds (A B .. B A) of a CUDA graph of back-to-back launches (at
least `LAUNCHES`, one per weight copy, the copies spanning 4x the L2 where the bytes allow, so each
call reads HBM and launch cost is amortised as in the decode graph), PDL on (`set_pdl`). MoE cases
have 0, 1, 2 of the token's k experts local (the others' ids outside this rank's [0, E)); each launch
of the graph picks other local experts, so their weights come from HBM too. Per row: median and
spread of the rounds, bytes (weights + scales + activations + output), GB/s and fraction of the copy
bandwidth measured at the start (and again at the end); per case the best candidate and the step's
ms at the launcher's and the best config (calls per step x time; a MoE case weighted by how often
uniform routing puts that many experts on the rank: 0.34, 0.40, 0.26 for 2+), and their totals over
the cases run. JSON to `--out`, rewritten after each case.

    python3 -m lab.diagnostics.rank_of_sweep --out rank_of_sweep.json [--budget-s 180]
    python3 -m lab.diagnostics.rank_of_sweep --smoke   # CPU, TRITON_INTERPRET=1, tiny shapes (rank of 4)
"""

from __future__ import annotations

import os
import sys

if "--smoke" in sys.argv:  # before Triton is imported: the interpreter runs the kernels on the CPU
    os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import re  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import asdict, dataclass, replace  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from backend.quant.experts import QuantExperts  # noqa: E402
from backend.quant.linear import Int4Linear  # noqa: E402
from benchmarks.engine.geometry import make_geometry  # noqa: E402
from benchmarks.engine.rank_of import join_alone  # noqa: E402
from benchmarks.engine.weights import build_random_model  # noqa: E402
from benchmarks.kernels.common import graph_ms, measure_ceilings, num_copies  # noqa: E402
from kernels.fused_moe import fused_moe, fused_moe_ref  # noqa: E402
from kernels.moe_routing import GEMV_CONFIG, MoEConfig, pick_moe_config  # noqa: E402
from kernels.split_k_merge import num_sms  # noqa: E402
from kernels.triton_lib import pdl_args, set_pdl  # noqa: E402
from kernels.w4a16_config import GEMV_DEFAULT, GEMV_NARROW, GEMV_TMA, W4A16Config, pick_config, with_split_k  # noqa: E402
from kernels.w4a16_gemm import w4a16_gemm, w4a16_gemm_ref  # noqa: E402
from lab.diagnostics.w4a16_decode_sweep import REPEATS, alternating  # noqa: E402

DEV = "cuda"  # --smoke: "cpu"
ACT = torch.bfloat16  # activations (--smoke: float16, as the interpreter's CPU tests run)
LAUNCHES = 20  # launches per graph at least (more where more weight copies are needed to pass the L2)
MAX_LAUNCHES = 512  # the smallest matrices (weights_proj, 4 x 6144) stay L2-resident rather than 20k copies
REP_MS = 20
DEADLINE = float("inf")  # time.time() past which no candidate is compiled nor case started (--budget-s)
MOE_LOCAL = (0, 1, 2)  # of the token's experts on this rank (the step's share of 2+ timed at 2)
MATCH = 1e-2  # rel. error to the launcher's output: summation order and bf16 rounding only
DEFAULT = "launcher"
# label -> (GEMV config, programs per SM its split aims at; 0: no split)
GEMV_CANDIDATES: dict[str, tuple[W4A16Config, int]] = {
    "plain 128x256 6/SM": (GEMV_DEFAULT, 6),
    "plain 128x256 24/SM": (GEMV_DEFAULT, 24),
    "plain 128x256 no split": (GEMV_DEFAULT, 0),
    "plain 64x256 12/SM": (replace(GEMV_DEFAULT, block_n=64), 12),
    "plain 64x256 24/SM": (replace(GEMV_DEFAULT, block_n=64), 24),
    "plain 32x256 24/SM": (replace(GEMV_DEFAULT, block_n=32), 24),
    "plain 128x128 12/SM": (replace(GEMV_DEFAULT, block_k=128), 12),
    "plain 128x512 12/SM": (replace(GEMV_DEFAULT, block_k=512), 12),
    "plain 256x256 w8 12/SM": (replace(GEMV_DEFAULT, block_n=256, num_warps=8), 12),
    "plain 64x256 w2 24/SM": (replace(GEMV_DEFAULT, block_n=64, num_warps=2), 24),
    "loop3 128x256 12/SM": (replace(GEMV_DEFAULT, loop_stages=3), 12),
    "prefetch 128x256 12/SM": (replace(GEMV_DEFAULT, prefetch=True), 12),
    "tma 128x256 s4 4/SM": (GEMV_TMA, 4),
    "tma 64x256 s4 8/SM": GEMV_NARROW,
    "tma 64x256 s4 16/SM": (GEMV_NARROW[0], 16),
}
# label -> fused-MoE GEMV config (both launches, gate/up and down; split 0: by `programs_per_sm`, which
# counts the grid's programs of every pair, though only local pairs' programs run a K loop)
MOE_CANDIDATES: dict[str, MoEConfig] = {
    "64x256 6/SM": replace(GEMV_CONFIG, programs_per_sm=6),
    "64x256 24/SM": replace(GEMV_CONFIG, programs_per_sm=24),
    "64x256 48/SM": replace(GEMV_CONFIG, programs_per_sm=48),
    "64x256 96/SM": replace(GEMV_CONFIG, programs_per_sm=96),
    "64x256 split 4": replace(GEMV_CONFIG, split_k=4),
    "64x256 split 12": replace(GEMV_CONFIG, split_k=12),
    "32x256 48/SM": replace(GEMV_CONFIG, block_n=32, programs_per_sm=48),
    "128x256 12/SM": replace(GEMV_CONFIG, block_n=128),
    "64x128 24/SM": replace(GEMV_CONFIG, block_k=128, programs_per_sm=24),
    "64x512 12/SM": replace(GEMV_CONFIG, block_k=512),
    "64x256 loop3 48/SM": replace(GEMV_CONFIG, loop_stages=3, programs_per_sm=48),
    "64x256 w8 12/SM": replace(GEMV_CONFIG, num_warps=8),
    "64x256 lift": replace(GEMV_CONFIG, lift=True),
}


@dataclass(frozen=True, slots=True)
class Gemv:
    names: tuple[str, ...]  # the modules of this shape (layer 0 attention / MLP, layer 1 shared expert)
    N: int
    K: int
    group: int
    out_dtype: torch.dtype  # float32 for the indexer's weights_proj
    calls_per_step: int  # in the full-depth step

    @property
    def nbytes(self) -> int:  # words, bf16 scales, x in, out
        return (
            self.N * self.K // 2
            + self.N * (self.K // self.group) * 2
            + 2 * self.K
            + self.N * self.out_dtype.itemsize
        )


@dataclass(frozen=True, slots=True)
class Moe:
    E: int  # local experts
    num_routed: int  # all ranks'
    top_k: int
    H: int
    I: int
    group: int
    calls_per_step: int  # fused_moe calls (two kernels each), whatever the local experts

    def share(self, num_local: int) -> float:
        """Of a step's MoE layers, the share with `num_local` of the token's experts on this rank under
        uniform routing (hypergeometric: top_k of num_routed, E local); the last case takes the tail."""

        def p(n: int) -> float:
            rest = self.num_routed - self.E
            return (
                math.comb(self.E, n)
                * math.comb(rest, self.top_k - n)
                / math.comb(self.num_routed, self.top_k)
            )

        return p(num_local) if num_local < max(MOE_LOCAL) else 1 - sum(p(n) for n in range(num_local))

    def nbytes(self, num_local: int) -> int:
        """Weights and scales of `num_local` experts, x in and out (the fp32 act round trip left out)."""
        per_expert = 3 * self.H * self.I // 2 + 3 * self.H * self.I // self.group * 2
        return num_local * per_expert + 4 * self.H


def layer_shapes(kind: str, rank_of: int, tiny: bool, dev: str) -> tuple[list[Gemv], Moe]:
    """The INT4 Linears and experts of a dense and a MoE layer as `build_random_model` makes them; calls
    per step from the full-depth geometry (attention every layer, the dense MLP in its first
    `first_k_dense_replace` layers, the shared expert and the routed experts in the rest)."""
    full = make_geometry(kind, None, tiny=tiny, rank_of=rank_of).text  # type: ignore[arg-type]
    num_layers, num_dense = int(full["num_hidden_layers"]), int(full["first_k_dense_replace"])
    geometry = make_geometry(kind, 2, tiny=tiny, rank_of=rank_of)  # type: ignore[arg-type]
    model = build_random_model(geometry, "int4-all", device=dev)
    found: dict[tuple[int, int, int, torch.dtype], tuple[list[str], int]] = {}
    moe = None
    for name, m in model.named_modules():
        found_layer = re.search(r"layers\.(\d+)\.", name)
        layer = int(found_layer.group(1)) if found_layer else -1
        calls = num_layers if ".self_attn." in name else num_dense if layer == 0 else num_layers - num_dense
        if isinstance(m, QuantExperts) and moe is None:
            moe = Moe(m.e1 - m.e0, int(full["n_routed_experts"]), int(full["num_experts_per_tok"]), m.hidden,
                      m.intermediate, m.scheme.group_size, num_layers - num_dense)  # fmt: skip
        if not isinstance(m, Int4Linear) or (layer == 1 and ".self_attn." in name):
            continue  # layer 1's attention is layer 0's
        out_dtype = torch.float32 if m.dense_dtype == torch.float32 else ACT  # weights_proj: fp32 out
        names, total = found.get((m.out_local, m.in_local, m.group_size, out_dtype), ([], 0))
        found[(m.out_local, m.in_local, m.group_size, out_dtype)] = ([*names, name], total + calls)
    del model
    assert moe is not None, "the MoE layer has no INT4 experts"
    shapes = [Gemv(tuple(ns), N, K, g, dt, c) for (N, K, g, dt), (ns, c) in found.items()]
    return sorted(shapes, key=lambda s: -s.nbytes * s.calls_per_step), moe  # most of the step first


def timer(calls: list[Callable[[], Any]]) -> Callable[[], float]:
    """ms per call: a CUDA graph of all `calls` back to back (CPU smoke: one eager call, the logic only)."""
    if DEV == "cuda":
        return lambda: graph_ms(calls, REP_MS)

    def eager() -> float:
        t0 = time.perf_counter()
        calls[0]()
        return (time.perf_counter() - t0) * 1e3

    return eager


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """|a - b| / |b|, 0 where both are zero (no local expert: the MoE's output is all zeros)."""
    return float((a.double() - b.double()).norm() / max(float(b.double().norm()), 1e-30))


def checked(
    label: str, run: Callable[[], torch.Tensor], base: torch.Tensor, ref: torch.Tensor
) -> dict[str, float] | None:
    """Errors of `run()`'s output to the launcher's and the reference; None (reported) if it fails or differs."""
    try:
        out = run()
    except Exception as exc:  # noqa: BLE001 (a candidate that fails is a result, not the end of the run)
        print(f"  {label}: {repr(exc)[:300]}\n{traceback.format_exc()[-1200:]}", flush=True)
        return None
    errs = {"rel_err_launcher": rel_diff(out, base), "rel_err_ref": rel_diff(out, ref)}
    if not errs["rel_err_launcher"] <= MATCH:
        print(
            f"  {label}: rel_err to the launcher {errs['rel_err_launcher']:.2e}: differs, not timed",
            flush=True,
        )
        return None
    return errs


def rows_of(case: str, calls: dict[str, Callable[[], float]], meta: dict[str, dict[str, Any]], nbytes: int,
            copy: float, calls_per_step: float) -> list[dict[str, Any]]:  # fmt: skip
    rows = []
    for label, ts in alternating(calls).items():
        med = statistics.median(ts)
        rows.append({
            "case": case, "candidate": label, "ms": med, "samples_ms": ts, "spread": (max(ts) - min(ts)) / med,
            "bytes": nbytes, "GBps": nbytes / med / 1e6, "copy_fraction": nbytes / med / 1e6 / copy,
            "calls_per_step": calls_per_step, "step_ms": med * calls_per_step, **meta[label],
        })  # fmt: skip
    return rows


def gemv_case(s: Gemv, copy: float, sms: int) -> list[dict[str, Any]]:
    copies = []
    for _ in range(min(max(LAUNCHES, num_copies(s.nbytes)), MAX_LAUNCHES) if DEV == "cuda" else 2):
        packed = torch.randint(-(2**31), 2**31 - 1, (s.N, s.K // 8), dtype=torch.int32, device=DEV)
        copies.append(
            (packed, (torch.rand(s.N, s.K // s.group, device=DEV) * 0.02 + 0.002).to(torch.bfloat16))
        )
    x = torch.randn(1, s.K, device=DEV).to(ACT)
    ref = w4a16_gemm_ref(x.float(), copies[0][0], copies[0][1].float())
    launcher = pick_config(1, s.N, s.K, sms, s.group)
    cands = {DEFAULT: launcher}
    for label, (cfg, per_sm) in GEMV_CANDIDATES.items():
        cands[label] = replace(cfg, split_k=1) if per_sm == 0 else with_split_k(cfg, 1, s.N, s.K, sms, per_sm)
    base = w4a16_gemm(x, *copies[0], s.group, config=launcher, out_dtype=s.out_dtype)
    calls: dict[str, Callable[[], float]] = {}
    meta: dict[str, dict[str, Any]] = {}
    seen: dict[W4A16Config, str] = {}
    for label, cfg in cands.items():
        if time.time() > DEADLINE:
            print(f"  budget: {label} and the rest not run", flush=True)
            break
        if cfg in seen:  # the same launch as an earlier candidate's: timed once
            print(f"  {label}: the same config as {seen[cfg]}", flush=True)
            continue
        seen[cfg] = label
        run = lambda cfg=cfg: w4a16_gemm(x, *copies[0], s.group, config=cfg, out_dtype=s.out_dtype)  # noqa: E731
        errs = checked(label, run, base, ref)
        if errs is None:
            continue
        meta[label] = {**errs, "config": asdict(cfg)}
        calls[label] = timer([
            lambda w=w, sc=sc, cfg=cfg: w4a16_gemm(x, w, sc, s.group, config=cfg, out_dtype=s.out_dtype)
            for w, sc in copies
        ])  # fmt: skip
    case = f"gemv N={s.N} K={s.K} g={s.group} {str(s.out_dtype)[6:]} {'+'.join(n.rsplit('layers.', 1)[-1] for n in s.names)}"
    rows = rows_of(case, calls, meta, s.nbytes, copy, s.calls_per_step)
    for r in rows:
        r["launches_per_graph"] = len(copies)
    return rows


def moe_case(moe: Moe, num_local: int, copy: float) -> list[dict[str, Any]]:
    E, H, I, g = moe.E, moe.H, moe.I, moe.group
    w13 = torch.randint(-(2**31), 2**31 - 1, (E, 2 * I, H // 8), dtype=torch.int32, device=DEV)
    s13 = torch.full((E, 2 * I, H // g), 0.004, device=DEV, dtype=torch.bfloat16)
    w2 = torch.randint(-(2**31), 2**31 - 1, (E, H, I // 8), dtype=torch.int32, device=DEV)
    s2 = torch.full((E, H, I // g), 0.004, device=DEV, dtype=torch.bfloat16)
    x = torch.randn(1, H, device=DEV).to(ACT)
    topk_w = torch.softmax(torch.randn(1, moe.top_k, device=DEV), -1)
    launches = LAUNCHES if DEV == "cuda" else 1
    ids = []  # launch j: local experts j·n .. j·n + n - 1 (mod E), the rest other ranks' (ids >= E)
    for j in range(launches):
        local = [(j * num_local + i) % E for i in range(num_local)]
        remote = [E + (j * moe.top_k + i) % (moe.num_routed - E) for i in range(moe.top_k - num_local)]
        ids.append(torch.tensor([local + remote], dtype=torch.int32, device=DEV))
    weights = (w13, s13, w2, s2)
    ref = fused_moe_ref(x, ids[0], topk_w, *weights, g)
    launcher = pick_moe_config(moe.top_k, E, GEMV_CONFIG)
    base = fused_moe(x, ids[0], topk_w, *weights, g, config=launcher)
    calls: dict[str, Callable[[], float]] = {}
    meta: dict[str, dict[str, Any]] = {}
    for label, cfg in {DEFAULT: launcher, **MOE_CANDIDATES}.items():
        if time.time() > DEADLINE:
            print(f"  budget: {label} and the rest not run", flush=True)
            break
        errs = checked(
            label, lambda cfg=cfg: fused_moe(x, ids[0], topk_w, *weights, g, config=cfg), base, ref
        )
        if errs is None:
            continue
        meta[label] = {**errs, "config": asdict(cfg)}
        calls[label] = timer(
            [lambda t=t, cfg=cfg: fused_moe(x, t, topk_w, *weights, g, config=cfg) for t in ids]
        )
    case = f"moe {num_local} of {moe.top_k} local E={E} H={H} I={I} g={g}"
    rows = rows_of(case, calls, meta, moe.nbytes(num_local), copy, moe.calls_per_step * moe.share(num_local))
    for r in rows:
        r["launches_per_graph"] = launches
    return rows


def print_case(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    if not rows:
        return None
    best, by = min(rows, key=lambda r: r["ms"]), {r["candidate"]: r for r in rows}
    for r in rows:
        print(f"  {r['candidate']:<26} {r['ms'] * 1e3:7.2f}us {r['spread']:6.1%} {r['GBps']:6.0f} GB/s "
              f"{r['copy_fraction']:5.2f} copy {r['rel_err_launcher']:8.1e}{' <- best' if r is best else ''}")  # fmt: skip
    base = by.get(DEFAULT, best)
    print(f"{rows[0]['case']}\n  => launcher {base['ms'] * 1e3:.2f}us ({base['copy_fraction']:.2f} of copy), best "
          f"{best['candidate']} {best['ms'] * 1e3:.2f}us = {base['ms'] / best['ms']:.2f}x; per step "
          f"{base['step_ms']:.3f} -> {best['step_ms']:.3f} ms\n", flush=True)  # fmt: skip
    return {"case": rows[0]["case"], "best": best["candidate"], "best_ms": best["ms"], "launcher_ms": base["ms"],
            "speedup": base["ms"] / best["ms"], "step_ms_launcher": base["step_ms"], "step_ms_best": best["step_ms"],
            "best_config": best["config"]}  # fmt: skip


def copy_gbps() -> dict[str, float]:
    if DEV == "cuda":
        return measure_ceilings()
    src = torch.randn(2**22)  # the smoke run: a CPU copy, only to exercise the fractions
    dst = torch.empty_like(src)
    t0 = time.perf_counter()
    dst.copy_(src)
    return {"copy_GBps": 2 * src.nbytes / (time.perf_counter() - t0) / 1e9}


def main() -> None:
    global DEV, ACT, DEADLINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "."), "rank_of_sweep.json"))
    ap.add_argument("--budget-s", type=float, default=180.0, help="no case or candidate starts past this")
    ap.add_argument("--rank-of", type=int, default=8)
    ap.add_argument(
        "--smoke", action="store_true", help="CPU, TRITON_INTERPRET=1, the tiny GLM at rank 0 of 4"
    )
    args = ap.parse_args()
    if args.smoke:  # tiny GLM has 4 heads: rank 0 of 4 at most
        DEV, ACT, args.rank_of = "cpu", torch.float16, min(args.rank_of, 4)
    start = time.time()
    DEADLINE = start + args.budget_s
    torch.manual_seed(0)
    set_pdl(True)
    join_alone(args.rank_of)
    listed, moe = layer_shapes("glm-5.2", args.rank_of, args.smoke, DEV)
    shapes = [s for s in listed if s.K % s.group == 0]  # a part group (tiny shapes only) is not the GEMV's
    if args.smoke:  # seconds: the two largest and the float32 output (weights_proj)
        shapes = shapes[:2] + [s for s in shapes[2:] if s.out_dtype == torch.float32]
    sms = num_sms(torch.device(DEV))
    ceil0 = copy_gbps()
    copy = ceil0["copy_GBps"]
    device = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(
        f"{device}: copy {copy:.0f} GB/s, {sms} SMs, PDL {pdl_args(torch.device(DEV))['PDL']}; rank 0 of {args.rank_of}"
    )
    for s in listed:
        print(f"  gemv N={s.N:<6} K={s.K:<6} g={s.group} {str(s.out_dtype)[6:]:<8} {s.nbytes / 1e6:6.2f} MB "
              f"x{s.calls_per_step:<4} {', '.join(s.names)}{'' if s in shapes else ' (not run)'}")  # fmt: skip
    print(f"  moe E={moe.E} of {moe.num_routed}, top {moe.top_k}, H={moe.H} I={moe.I} g={moe.group}, "
          f"{moe.nbytes(1) / 1e6:.1f} MB an expert, x{moe.calls_per_step}, of them local "
          f"{', '.join(f'{n}: {moe.share(n):.2f}' for n in MOE_LOCAL)}\n", flush=True)  # fmt: skip
    record: dict[str, Any] = {
        "device": device, "copy_GBps": [copy], "ceilings": ceil0, "sms": sms, "rank_of": args.rank_of,
        "pdl": pdl_args(torch.device(DEV))["PDL"], "repeats": REPEATS, "rep_ms": REP_MS, "min_launches": LAUNCHES,
        "command": " ".join(["python3 -m lab.diagnostics.rank_of_sweep", *sys.argv[1:]]),
        "gemv_shapes": [
            {**asdict(s), "out_dtype": str(s.out_dtype), "bytes": s.nbytes, "run": s in shapes} for s in listed
        ],
        "moe": asdict(moe), "rows": [], "best": [],
    }  # fmt: skip
    gemvs = [lambda s=s: gemv_case(s, copy, sms) for s in shapes]
    moes = [lambda n=n: moe_case(moe, n, copy) for n in sorted(MOE_LOCAL, key=lambda n: -moe.share(n))]
    todo: list[Callable[[], list[dict[str, Any]]]] = [
        *gemvs[:2],
        moes[0],
        *gemvs[2:],
        *moes[1:],
    ]  # likeliest MoE 3rd
    for case in todo:
        if time.time() > DEADLINE:
            print("budget: a case skipped", flush=True)
            continue
        rows = case()
        if DEV == "cuda":
            torch.cuda.empty_cache()
        record["rows"] += rows
        if (best := print_case(rows)) is not None:
            record["best"].append(best)
        with open(args.out, "w") as f:  # a timeout keeps what ran
            json.dump(record, f, indent=1)
    record["copy_GBps"].append(copy_gbps()["copy_GBps"])
    step = {k: sum(b[k] for b in record["best"]) for k in ("step_ms_launcher", "step_ms_best")}
    record["step_totals_ms"] = step
    print(f"copy at the end {record['copy_GBps'][1]:.0f} GB/s (start {copy:.0f}); {time.time() - start:.0f}s; "
          f"cases run, per step: launcher {step['step_ms_launcher']:.3f} ms, best per shape {step['step_ms_best']:.3f} ms")  # fmt: skip
    with open(args.out, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    main()

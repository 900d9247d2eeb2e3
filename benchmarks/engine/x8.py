"""The 8-GPU run's record (issue 23, `benchmarks/x8.sh`): the stage records in one folder, combined.

    python -m benchmarks.engine.x8 DIR [--out X.json]   # X.json + X.md, and the table printed

Each stage record is a `kumo bench engine scenario … --tp 8` record named `<stage>-…json` (x8.sh names
them). A stage that runs one side a process (`--side A` / `--side B`: the GLM variants do not fit
together, and the Kimi sides each take the whole KV pool) gives its ratio here as `kumo bench engine
combine` does (`benchmarks.engine.side_records.Pairing`): its processes, in the order they started,
paired by rounds A, B, B, A, a round's ratio (a1 + a2) / (b1 + b2) of the processes' mean metric, one
sample a round; `{"value": median, "samples": [...], "spread": [min, max]}` as the benchmark issue's
summary. A process missing, or without a complete run, costs its own round only: the processes left
out are named under `unpaired`, by stage.

    glm-decode        int4_vs_fp8_decode_c1: tok/s per user at c=1, INT4 / FP8 (every Linear)
    glm-prefill       int4_vs_fp8_prefill: prefill tok/s of one 8,192-token prompt, INT4 / FP8
    kv-long           fp8kv_vs_bf16kv_long_c64: output tok/s end to end, FP8 KV / BF16 KV (steady-
                      decode ratio beside)
    kv-capacity       capacity_fp8_over_bf16: KV tokens held at the first preemption, FP8 / BF16;
    kv-capacity-dcp8  the same with DCP8 (the tokens of each side beside)
    load              Kimi K2.6, INT4 experts + FP8 KV at each concurrency: tok/s per user and per
                      GPU, TTFT and TPOT p50 / p99 over every request of every timed run, vs vLLM
    tags              integrity_overhead: A/B/B/A in one process (both sides fit: --pool-scale)
    comms             the collectives' share of rank 0's device time in a profiled decode step
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from pathlib import Path
from typing import Any

from benchmarks.engine import method
from benchmarks.engine.side_records import Pairing, in_order, process_value, side_entry

RATIO_STAGES = {  # stage → (summary key, the metric's run field)
    "glm-decode": ("int4_vs_fp8_decode_c1", "output_tok_s_per_user"),
    "glm-prefill": ("int4_vs_fp8_prefill", "prefill_tok_s"),
    "kv-long": ("fp8kv_vs_bf16kv_long_c64", "output_tok_s"),
    "kv-capacity": ("capacity_fp8_over_bf16", "kv_tokens_held"),
    "kv-capacity-dcp8": ("capacity_fp8_over_bf16_dcp8", "kv_tokens_held"),
}
SUMMARY_KEYS = (
    "int4_vs_fp8_decode_c1",
    "int4_vs_fp8_prefill",
    "fp8kv_vs_bf16kv_long_c64",
    "capacity_fp8_over_bf16",
    "integrity_overhead",
)
GOALS = {
    "int4_vs_fp8_decode_c1": ("1.55x (+55%)", ">= 1.6x"),
    "int4_vs_fp8_prefill": ("0.85x", ">= 0.95x"),
    "fp8kv_vs_bf16kv_long_c64": ("1.41x", ">= 1.45x"),
    "capacity_fp8_over_bf16": ("~686k / ~1.37M tokens", ">= 1.99x"),
    "capacity_fp8_over_bf16_dcp8": ("-", "FP8 >= 10M tokens"),
    "integrity_overhead": ("-", "<= +1%"),
}
VLLM_K25_INT4_TP8 = {4: 91.2, 16: 46.6, 32: 28.9, 64: 16.7}  # tok/s per user, no speculative decoding
STAGES = ("glm-decode", "glm-prefill", "kv-long", "kv-capacity", "kv-capacity-dcp8", "load", "tags", "comms")


def stage_of(path: Path) -> str:
    """x8.sh names a record `<stage>-<part>-<time>.json`: the longest stage name it starts with."""
    return max((s for s in STAGES if path.name.startswith(s + "-")), key=len, default="")


def load(folder: Path) -> list[tuple[str, dict[str, Any]]]:
    """(stage, record) of every stage record in `folder`, in the order they were written."""
    out = []
    for path in sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime):
        stage = stage_of(path)
        if stage:
            record = json.loads(path.read_text())
            if record.get("scenarios"):
                out.append((stage, record))
    return out


def _entry(record: dict[str, Any]) -> dict[str, Any]:
    (entry,) = record["scenarios"].values()
    return dict(entry)


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def load_rows(entries: list[tuple[dict[str, Any], int]]) -> list[dict[str, Any]]:
    """One row per concurrency: tok/s per user and per GPU, TTFT / TPOT p50 and p99, vs vLLM."""
    by_c: dict[int, list[tuple[dict[str, Any], int]]] = {}
    for e, tp in entries:
        by_c.setdefault(e["workload"]["concurrency"], []).append((e, tp))
    rows = []
    for c, group in sorted(by_c.items()):
        runs = [(run, tp) for e, tp in group for run in e["runs"] if run["is_complete"]]
        if not runs:
            rows.append({"concurrency": c, "runs": 0})
            continue
        ttft = [t for run, _ in runs for t in run["extra"].get("ttft_ms_per_request", [])]
        tpot = [t for run, _ in runs for t in run["extra"].get("tpot_ms_per_request", [])]
        per_user = statistics.median(run["output_tok_s_per_user"] for run, _ in runs)
        peer = VLLM_K25_INT4_TP8.get(c)
        w = group[0][0]["workload"]
        rows.append({
            "concurrency": c, "runs": len(runs), "input_len": w["input_len"], "output_len": w["output_len"],
            "tok_s_per_user": per_user,
            "tok_s_per_user_samples": [run["output_tok_s_per_user"] for run, _ in runs],
            "output_tok_s_per_gpu": statistics.median(run["output_tok_s"] / tp for run, _ in runs),
            "ttft_ms_p50": _pct(ttft, 0.5), "ttft_ms_p99": _pct(ttft, 0.99),
            "tpot_ms_p50": _pct(tpot, 0.5), "tpot_ms_p99": _pct(tpot, 0.99),
            "vllm_k25_int4_tp8_tok_s_per_user": peer,
            "over_vllm": per_user / peer if peer else None,
        })  # fmt: skip
    return rows


def comms_rows(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The collectives' share of each profiled step on rank 0, by concurrency: of its device time
    (CUDA: NCCL kernels, which include waiting for the slowest rank) and of its wall time."""
    rows = []
    for e in entries:
        for step, p in (e.get("step_profile") or {}).items():
            total = p.get("device_ms_total") or 0.0
            rows.append({
                "concurrency": e["workload"]["concurrency"], "step": step, "decode_rows": p["decode_rows"],
                "wall_ms": p["wall_ms"], "device_ms_total": total, "collective_ms": p.get("collective_ms"),
                "collective_share": p["collective_ms"] / total if total and p.get("collective_ms") is not None else None,
                "collective_share_of_wall": p["collective_ms"] / p["wall_ms"] if p.get("collective_ms") is not None else None,
            })  # fmt: skip
    return sorted(rows, key=lambda r: (r["concurrency"], r["step"]))


def combine(stage_records: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """The run's record: the summary keys, the figures beside them, the load and comms tables."""
    by_stage: dict[str, list[dict[str, Any]]] = {}
    for stage, record in stage_records:
        by_stage.setdefault(stage, []).append(record)
    summary: dict[str, Any] = dict.fromkeys(SUMMARY_KEYS)
    beside: dict[str, Any] = {}
    unpaired: dict[str, list[str]] = {}
    for stage, (key, field) in RATIO_STAGES.items():
        entries = [side_entry(r) or {} for r in in_order(by_stage.get(stage, []))]
        if not entries:
            continue
        pairing = Pairing.of(entries, field)
        summary[key] = pairing.summary()
        if pairing.unpaired:
            unpaired[stage] = [pairing.labels[j] for j in pairing.unpaired]
        if stage == "kv-long":  # the same rounds' ratio of steady decode
            steady = [process_value(e, "steady_decode_tok_s", extra=True) for e in entries]
            beside["fp8kv_vs_bf16kv_long_c64_steady_decode"] = pairing.summary(steady)
    tags = [_entry(r) for r in by_stage.get("tags", [])]
    if tags:  # A/B/B/A in-process: the rounds of every call pooled
        samples = [s for e in tags if e.get("summary") for s in e["summary"]["samples"]]
        summary["integrity_overhead"] = method.summary_entry(samples) if samples else None
    load_entries = [(_entry(r), r.get("parallel", {}).get("tp", 1)) for r in by_stage.get("load", [])]
    return {
        "issue": 23,
        "date": datetime.date.today().isoformat(),
        "summary": {k: summary.get(k) for k in SUMMARY_KEYS},
        "beside": beside | {"capacity_fp8_over_bf16_dcp8": summary.get("capacity_fp8_over_bf16_dcp8")},
        "unpaired": unpaired,  # stage → its processes in no A, B, B, A round (A1, B2, …: side, place)
        "load": load_rows(load_entries),
        "comms": comms_rows([_entry(r) for r in by_stage.get("comms", [])]),
        "sources": [
            {
                "stage": s,
                "command": r["command"],
                "date": r["date"],
                "device": r["device"],
                "parallel": r.get("parallel"),
                "machine": r.get("machine"),
                "wall_s": r.get("wall_s"),
                "follower_exit_codes": r.get("follower_exit_codes"),
            }
            for s, r in stage_records
        ],  # fmt: skip
        "records": [r for _, r in stage_records],  # every sample
    }


def _f(x: Any, fmt: str = "{:.3f}") -> str:
    return "-" if x is None else fmt.format(x)


def markdown(x8: dict[str, Any]) -> str:
    lines = [
        f"# The 8-GPU run (issue 23), {x8['date']}",
        "",
        "| key | median | spread | samples | Cloudflare | goal |",
        "|---|---|---|---|---|---|",
    ]
    for key, v in list(x8["summary"].items()) + [
        (k, v) for k, v in x8["beside"].items() if isinstance(v, dict) or v is None
    ]:
        seed, goal = GOALS.get(key, ("-", "-"))
        if v is None:
            lines.append(f"| {key} | not measured | | 0 | {seed} | {goal} |")
        else:
            lines.append(
                f"| {key} | {_f(v['value'])} | [{_f(v['spread'][0])}, {_f(v['spread'][1])}] "
                f"| {len(v['samples'])} | {seed} | {goal} |"
            )
    for stage, labels in x8["unpaired"].items():
        lines.append(f"\n{stage}: processes {', '.join(labels)} in no A, B, B, A round, left out.")
    for key in ("capacity_fp8_over_bf16", "capacity_fp8_over_bf16_dcp8"):
        v = x8["summary"].get(key) or x8["beside"].get(key)
        if v:
            lines.append(f"\n{key}: KV tokens held, FP8 {v['A']} / BF16 {v['B']}.")
    if x8["load"]:
        lines += [
            "",
            "Kimi K2.6, INT4 experts + FP8 KV (vLLM: K2.5 INT4, TP8, H200, no speculative decoding, 8k / 1k):",
            "",
            "| c | prompt / output | runs | tok/s/user | tok/s/GPU | TTFT p50 ms | TTFT p99 | TPOT p50 ms | TPOT p99 "
            "| vLLM | x vLLM |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in x8["load"]:
            lines.append(
                f"| {r['concurrency']} | {r.get('input_len', '-')} / {r.get('output_len', '-')} | {r['runs']} | {_f(r.get('tok_s_per_user'), '{:.1f}')} "
                f"| {_f(r.get('output_tok_s_per_gpu'), '{:.1f}')} | {_f(r.get('ttft_ms_p50'), '{:.0f}')} "
                f"| {_f(r.get('ttft_ms_p99'), '{:.0f}')} | {_f(r.get('tpot_ms_p50'), '{:.1f}')} "
                f"| {_f(r.get('tpot_ms_p99'), '{:.1f}')} | {_f(r.get('vllm_k25_int4_tp8_tok_s_per_user'), '{:.1f}')} "
                f"| {_f(r.get('over_vllm'), '{:.2f}')} |"
            )
    if x8["comms"]:
        lines += ["", "Collectives in a profiled step on rank 0 (share of its device time; of its wall time):", "",
                  "| c | step | decode rows | wall ms | device ms | collectives ms | share | of wall |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for r in x8["comms"]:
            lines.append(
                f"| {r['concurrency']} | {r['step']} | {r['decode_rows']} | {_f(r['wall_ms'], '{:.2f}')} "
                f"| {_f(r['device_ms_total'], '{:.2f}')} | {_f(r['collective_ms'], '{:.2f}')} "
                f"| {_f(r['collective_share'], '{:.1%}')} | {_f(r['collective_share_of_wall'], '{:.1%}')} |"
            )
    lines += ["", "Sources:"] + [f"- {s['stage']}: `{s['command']}` ({s['device']})" for s in x8["sources"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.engine.x8", description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument("--out", type=Path, default=None, help="default: FOLDER/<date>-x8.json")
    a = ap.parse_args(argv)
    x8 = combine(load(a.folder))
    out = a.out or a.folder / f"{x8['date']}-x8.json"
    out.write_text(json.dumps(x8, indent=1) + "\n")
    md = markdown(x8)
    out.with_suffix(".md").write_text(md)
    print(md + f"wrote {out}, {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

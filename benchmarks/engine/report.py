"""The record (JSON), its summary ratios, a Markdown table, a projection and PNG plots.

Record: `{command, date, device, geometry, comparisons, options, machine, variants, runs, integrity,
transformers, scenarios, summary, summary_detail, projection}`. `runs` is flat: one row per Kumo run
(`source: "kumo"`, its `variant`) and per transformers run (`source: "transformers"`, its `mode`).
`scenarios` holds what `kumo bench engine scenario NAME` measured (`benchmarks.engine.scenarios`).
The summary has every key of TARGETS: `{"value": median, "samples": [ratio per A/B/B/A round],
"spread": [min, max]}` from the scenario of that name, or null when the record holds none (a
concurrency sweep measures no ratio; `kumo bench engine report A.json B.json …` merges calls and
pools the rounds of one scenario split over several calls).
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

from benchmarks.engine.method import summary_entry

# (Cloudflare's figure, goal) per summary key, from issue 25; each is measured by the scenario of its
# name (`kumo bench engine scenario KEY`, benchmarks/engine/scenarios.py)
TARGETS: dict[str, tuple[str, str]] = {
    "fp8kv_vs_bf16kv_long_c64": ("1.41x", ">= 1.45x"),
    "fp8kv_vs_bf16kv_c1": ("a few % below 1.0x", ">= 1.0x"),
    "int4_vs_fp8_decode_c1": ("1.55x", ">= 1.6x"),
    "int4_vs_fp8_prefill": ("0.85x", ">= 0.95x"),
    "integrity_overhead": ("-", "<= +1%"),
    "vs_transformers_c64": ("-", ">= 10x"),
    "capacity_fp8_over_bf16": ("-", ">= 1.99x"),
}


def device_name(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    import platform

    return f"cpu ({platform.processor() or platform.machine()})"


def new_record(
    command: str, device: str, geometry: dict[str, Any], options: dict[str, Any], comparison: str
) -> dict[str, Any]:
    import torch

    return {
        "command": command,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "geometry": geometry,
        "comparisons": [comparison],
        "options": options,
        "variants": [],
        "runs": [],
        "integrity": None,
        "transformers": None,
    }


def add_variant(record: dict[str, Any], result: dict[str, Any]) -> None:
    runs = result.pop("runs")
    record["variants"].append(result)
    record["runs"] += [{"source": "kumo", "kind": record["geometry"]["kind"]} | r for r in runs]


def add_transformers(record: dict[str, Any], result: dict[str, Any]) -> None:
    """Set (or replace, when called again with more modes done) the peer's result and its runs."""
    record["transformers"] = result
    record["runs"] = [r for r in record["runs"] if r["source"] != "transformers"]
    for mode, entry in result.get("modes", {}).items():
        record["runs"] += [
            {"source": "transformers", "variant": f"transformers/{mode}", "kind": record["geometry"]["kind"]}
            | r
            for r in entry["runs"]
        ]


# ---- summary ----------------------------------------------------------------------------------------
def _kumo(record: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        r for r in record["runs"] if r["source"] == "kumo" and r.get("extra", {}).get("is_complete", True)
    ]


def summarize(record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """Every key of TARGETS: the summary entry of the scenario record that measured it, else None
    (a concurrency sweep — `weights`, `kv`, `variant` — measures no ratio: one sample a point)."""
    scenarios = {  # one side alone (`--side`) measures no ratio: its two records combine (x8.py)
        k: e for k, e in (record.get("scenarios") or {}).items() if e is not None and "side" not in e
    }
    summary = {k: (scenarios[k]["summary"] if k in scenarios else None) for k in TARGETS}
    detail = {
        k: scenarios[k]["definition"]
        if k in scenarios
        else f"not measured here: `kumo bench engine scenario {k}`"
        for k in TARGETS
    }
    return summary, detail


def projection(record: dict[str, Any]) -> list[dict[str, Any]]:
    """Crude projection to the full model on 8 GPUs: decode step × full layers / truncated layers / 8."""
    g = record["geometry"]
    scale = g["full_num_layers"] / g["num_layers"] / 8
    rows = []
    for r in _kumo(record):
        if r.get("tpot_ms_p50") and r["tpot_ms_p50"] == r["tpot_ms_p50"]:
            tpot = r["tpot_ms_p50"] * scale
            rows.append({"kind": record["geometry"]["kind"], "variant": r["variant"], "concurrency": r["concurrency"],
                         "projected_tpot_ms": tpot,
                         "projected_tok_s_per_user": 1e3 / tpot, "projected_output_tok_s_per_gpu": r["concurrency"] * 1e3 / tpot / 8})  # fmt: skip
    return rows


def finish(record: dict[str, Any]) -> dict[str, Any]:
    record["summary"], record["summary_detail"] = summarize(record)
    record["projection"] = projection(record)
    record["projection_note"] = (
        "PROJECTION, not a measurement: measured TPOT x (full layers / truncated layers) / 8 GPUs, assuming "
        "perfect tensor-parallel scaling and no communication; the truncated run's KV per layer already "
        "is the per-GPU share, so this over-credits KV reads."
    )
    return record


def merge(records: list[dict[str, Any]]) -> dict[str, Any]:
    out = dict(records[0])
    out["comparisons"] = [c for r in records for c in r["comparisons"]]
    out["geometries"] = [r["geometry"] for r in records]
    out["variants"] = [
        dict(v, kind=r["geometry"]["kind"], layers=_layers(r)) for r in records for v in r["variants"]
    ]
    out["runs"] = [
        {"kind": r["geometry"]["kind"], "layers": _layers(r), **x} for r in records for x in r["runs"]
    ]
    out["integrity"] = next((r["integrity"] for r in records if r.get("integrity")), None)
    out["transformers"] = next((r["transformers"] for r in records if r.get("transformers")), None)
    out["sources"] = [
        {"command": r["command"], "date": r["date"], "comparisons": r["comparisons"]} for r in records
    ]
    out["scenarios"] = _merge_scenarios(records)
    out["machines"] = [r.get("machine") for r in records]
    out["summary"], out["summary_detail"] = summarize(out)
    out["projection"] = [
        dict(p, kind=r["geometry"]["kind"], layers=_layers(r)) for r in records for p in projection(r)
    ]
    return out


def _merge_scenarios(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Per scenario, its rounds pooled over the records that ran it on the same device, geometry, depth
    and workload (calls that split the rounds of one measurement; an H100's rounds pooled with an
    H200's were reported as the H200's); where records differ there, the group
    at the scenario's own workload (its concurrency and lengths: a cut workload measures something
    else) is kept, then the one measured deepest (the largest share of the full depth), then the one
    with the most rounds, then the newest, and the others are named in `not_pooled`."""
    from benchmarks.engine.scenarios import SCENARIOS  # torch, only when there are scenarios to merge

    groups: dict[str, dict[str, list[tuple[dict[str, Any], dict[str, Any]]]]] = {}
    for r in records:
        for name, entry in (r.get("scenarios") or {}).items():
            key = json.dumps([r.get("device"), r["geometry"]["kind"], _layers(r), entry["workload"],
                              entry["sides"]["A"]["label"], entry["sides"]["B"]["label"]], sort_keys=True)  # fmt: skip
            groups.setdefault(name, {}).setdefault(key, []).append((r, entry))
    out: dict[str, Any] = {}
    for name, by_key in groups.items():
        scenario = SCENARIOS.get(name)
        point = None if scenario is None else [scenario.concurrency, scenario.input_len, scenario.output_len]
        best = max(by_key.values(), key=lambda group: _preference(group, point))
        pooled = dict(best[0][1])
        pooled["rounds"] = [x for _, e in best for x in e["rounds"]]
        pooled["order"] = [s for _, e in best for s in e["order"]]
        samples = [x for _, e in best if e["summary"] for x in e["summary"]["samples"]]
        pooled["summary"] = summary_entry(samples) if samples else None
        pooled["sources"] = [
            {"command": r["command"], "date": r["date"], "machine": r.get("machine")} for r, _ in best
        ]
        pooled["not_pooled"] = [r["command"] for g in by_key.values() if g is not best for r, _ in g]
        first = best[0][0]
        pooled["measured_on"] = {"kind": first["geometry"]["kind"], "layers": _layers(first),
                                 "full_layers": first["geometry"]["full_num_layers"], "device": first["device"],
                                 "rank_of": first["geometry"].get("rank_of", 1)}  # fmt: skip
        out[name] = pooled
    return out


def _preference(
    group: list[tuple[dict[str, Any], dict[str, Any]]], point: list[int] | None
) -> tuple[bool, float, int, str]:
    first, entry = group[0]
    w = entry["workload"]
    is_point = [w["concurrency"], w["input_len"], w["output_len"]] == point
    depth = _layers(first) / int(first["geometry"]["full_num_layers"])
    return is_point, depth, sum(len(e["rounds"]) for _, e in group), max(r["date"] for r, _ in group)


def _layers(record: dict[str, Any]) -> int:
    return int(record["geometry"]["num_layers"])


# ---- Markdown --------------------------------------------------------------------------------------
def _short_warm_up(warm: dict[str, Any]) -> str:
    """How a warm-up shorter than the workload reached the timed shapes (`benchmarks.engine.warm_plan`)."""
    if "lengths" not in warm:
        return ""
    text = f": the workload at {warm['lengths'][0]} / {warm['lengths'][1]} tokens"
    if "probed_shapes" in warm:
        matched = {True: "it matched", False: "it did NOT match"}[warm.get("plan_matched_timed", False)]
        text += (f", then a probe of each of the {len(warm['probed_shapes'])} timed shapes the scheduler "
                 f"planned that it had not run (the plan: {matched} the timed runs)")  # fmt: skip
    return text


def _f(x: Any, fmt: str = "{:.1f}") -> str:
    return "-" if x is None or x != x else fmt.format(x)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:+.2%}"


def markdown(record: dict[str, Any]) -> str:
    g = record["geometry"]
    geometries = record.get("geometries", [g])
    merged = len({x["kind"] for x in geometries}) > 1
    depths = (
        len({x["num_layers"] for x in geometries}) > 1
    )  # e.g. the transformers peer at 3 layers, the rest 4

    def name(
        x: dict[str, Any],
    ) -> str:  # a merged record's rows name their geometry (and depth, where they differ)
        kind = f"{x.get('kind', '?')} ({x.get('layers', '?')} layers)" if depths else x.get("kind", "?")
        return f"{kind} {x['variant']}" if merged or depths else x["variant"]

    shapes = sorted({(x["kind"], x["num_layers"], x["full_num_layers"]) for x in geometries})
    layers_text = (
        ", ".join(f"{k} {n} of {full}" for k, n, full in shapes) + " layers"
        if depths
        else f"{g['num_layers']} of {g['full_num_layers']} layers"
    )

    lines = [
        f"# Engine benchmark: {', '.join(record['comparisons'])}",
        "",
        f"{record['date']} on {record['device']} (torch {record.get('torch', '?')}). Geometry: "
        f"{' and '.join(sorted({x['kind'] for x in record.get('geometries', [g])}))} "
        f"published per-layer shapes, {layers_text} ({g['dense_layers']} dense), "
        f"random weights; {g['routing']}. KV pool per layer = the full model's per-GPU pool on 8 H200s (`kumo plan`).",
        "",
        "| summary | median | spread | rounds | Cloudflare | goal | definition |",
        "|---|---|---|---|---|---|---|",
    ]
    for k, v in record["summary"].items():
        seed, goal = TARGETS[k]
        shown = [_ratio_text(k, x) for x in ((v["value"], *v["spread"]) if v else (None, None, None))]
        lines.append(
            f"| {k} | {shown[0]} | [{shown[1]}, {shown[2]}] | {len(v['samples']) if v else 0} | {seed} | {goal} "
            f"| {record['summary_detail'][k]} |"
        )
    for name, entry in (record.get("scenarios") or {}).items():
        lines += _scenario_lines(name, entry)
    machines = record.get("machines") or [record.get("machine")]
    fresh = [m["is_fresh"] for m in machines if m]
    if fresh:
        lines.append(
            f"\nFresh machine (first benchmark process on its compile cache): {', '.join(map(str, fresh))}."
        )
    if not record["variants"] and not record["runs"]:  # a scenario record: its own tables above
        return "\n".join(lines) + "\n"
    lines += ["", "| variant | weights GB | KV tokens | max conc. | prefill tok/s |", "|---|---|---|---|---|"]
    for v in record["variants"]:
        pf = (v.get("prefill") or {}).get("prefill_tok_s")
        lines.append(
            f"| {name(v)} | {v['weight_bytes'] / 1e9:.3g} | {v['kv_capacity_tokens']:,} | {v['max_concurrency']} | {_f(pf)} |"
        )
    lines += [
        "",
        "| run | conc. | out tok/s | tok/s/user | TTFT p50 ms | TPOT p50 ms | decode step p50 ms | preempt. |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in record["runs"]:
        lines.append(
            f"| {name(r)} | {r['concurrency']} | {_f(r.get('output_tok_s'))} | {_f(r.get('output_tok_s_per_user'))} "
            f"| {_f(r.get('ttft_ms_p50'))} | {_f(r.get('tpot_ms_p50'))} "
            f"| {_f((r.get('extra') or {}).get('decode_step_ms_p50'), '{:.2f}')} | {r.get('preemptions', '-')} |"
        )
    for v in record["variants"]:
        if v.get("step_profile"):
            lines.append(f"\n{name(v)} at concurrency {v['step_profile']['concurrency']} (an untimed run):")
            lines += _step_profile_lines(v["step_profile"]["steps"])
    hf = record.get("transformers") or {}
    for mode, entry in hf.get("modes", {}).items():
        if entry.get("error"):
            lines.append(f"\ntransformers {mode}: **failed**: {entry['error']}")
    integ = record.get("integrity")
    if integ:
        lines.append(
            f"\nIntegrity A/B at concurrency {integ['concurrency']}, {integ['on']['n']}+{integ['off']['n']} interleaved runs, "
            f"switched: {integ['switched']}: TPOT on {_f(integ['on']['tpot_ms_median'], '{:.2f}')} ms "
            f"[{_f(integ['on']['tpot_ms_min'], '{:.2f}')}, {_f(integ['on']['tpot_ms_max'], '{:.2f}')}], off "
            f"{_f(integ['off']['tpot_ms_median'], '{:.2f}')} ms [{_f(integ['off']['tpot_ms_min'], '{:.2f}')}, "
            f"{_f(integ['off']['tpot_ms_max'], '{:.2f}')}]; per round on/off - 1: median "
            f"{_pct(integ.get('overhead'))} [{_pct(integ.get('overhead_min'))}, {_pct(integ.get('overhead_max'))}]."
        )
    if record.get("projection"):
        lines += [
            "",
            f"**{record.get('projection_note', 'Projection')}**",
            "",
            "| variant | conc. | projected TPOT ms | tok/s/user | out tok/s per GPU |",
            "|---|---|---|---|---|",
        ]
        for p in record["projection"]:
            lines.append(
                f"| {name(p)} | {p['concurrency']} | {p['projected_tpot_ms']:.2f} | {p['projected_tok_s_per_user']:.1f} | {p['projected_output_tok_s_per_gpu']:.1f} |"
            )
    return "\n".join(lines) + "\n"


def _ratio_text(key: str, x: float | None) -> str:
    return "-" if x is None else (f"{x:+.2%}" if key == "integrity_overhead" else f"{x:.3f}x")


def _scenario_lines(name: str, e: dict[str, Any]) -> list[str]:
    """A scenario's sides, warm-up, and every run of every round in the order it ran."""
    w = e["workload"]
    if "side" in e:  # one side alone: its runs
        lines = ["", f"**{name}**, side {e['side']} alone ({e['sides'][e['side']]['label']}): {e['definition']}; "
                 f"{w['concurrency']} x {w['input_len']} / {w['output_len']} tokens.", "",
                 "| run | tok/s | tok/s/user | TTFT p50 ms | TPOT p50 ms | wall s | " + e["metric"] + " |",
                 "|---|---|---|---|---|---|---|"]  # fmt: skip
        for run in e["runs"]:
            lines.append(
                f"| {run.get('variant', '')} | {_f(run.get('output_tok_s'))} | {_f(run.get('output_tok_s_per_user'))} "
                f"| {_f(run.get('ttft_ms_p50'))} | {_f(run.get('tpot_ms_p50'))} | {_f(run.get('wall_s'), '{:.2f}')} "
                f"| {_f(run.get(e['metric']))} |"
            )
        return lines
    a, b = e["sides"]["A"], e["sides"]["B"]
    lines = [
        "",
        f"**{name}**: {e['definition']}. A = {a['label']}, B = {b['label']}; {w['concurrency']} x "
        f"{w['input_len']} / {w['output_len']} tokens, chunk {w['chunk']}, pool x {w['pool_scale']}.",
    ]
    warm = e.get("warm_up")
    missed = {k: v for k, v in (e.get("warm_up_missed_shapes") or {}).items() if v}
    if warm:
        lines.append(
            "Warm-up: "
            + ", ".join(
                f"{k} {v['s']:.1f} s ({v.get('num_step_shapes', 0)} step shapes{_short_warm_up(v)})"
                for k, v in warm.items()
            )
            + (
                f"; timed step shapes it missed: {missed}"
                if missed
                else "; it ran every step shape the timed runs ran."
            )
        )
    else:
        lines.append(f"No warm-up (a cold measurement): timed step shapes it missed: {missed}.")
    graphs = {k: side.get("decode_graphs") for k, side in e["sides"].items() if side.get("decode_graphs")}
    if graphs:  # whether pure-decode steps replayed CUDA graphs, and how many of the timed ones did
        replays = {k: sum(run.get("graph_replays", 0) for r in e["rounds"] for run in r["runs"] if run["side"] == k)
                   for k in graphs}  # fmt: skip
        lines.append(
            "Decode graphs: "
            + ", ".join(f"{k} {state} ({replays[k]} timed replays)" for k, state in graphs.items())
            + "."
        )
    for field, entry in (e.get("beside") or {}).items():
        if isinstance(entry, dict):
            lines.append(
                f"Beside: {field} {entry['value']:.3f} [{entry['spread'][0]:.3f}, {entry['spread'][1]:.3f}]."
            )
        elif entry is not None:
            lines.append(f"Beside: {field} {entry:.3f}.")
    lines += ["", "| round | side | run | tok/s | tok/s/user | TTFT p50 ms | TPOT p50 ms | wall s | ratio |",
              "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for i, r in enumerate(e["rounds"]):
        for j, run in enumerate(r["runs"]):
            ratio = _f(r["ratio"], "{:.3f}") if j == len(r["runs"]) - 1 else ""
            lines.append(
                f"| {i + 1} | {run['side']} | {run.get('variant', '')} | {_f(run.get('output_tok_s'))} "
                f"| {_f(run.get('output_tok_s_per_user'))} | {_f(run.get('ttft_ms_p50'))} | {_f(run.get('tpot_ms_p50'))} "
                f"| {_f(run.get('wall_s'), '{:.2f}')} | {ratio} |"
            )
    return lines


def _step_profile_lines(profiles: dict[str, dict[str, Any]], *, rows: int = 8) -> list[str]:
    """`benchmarks.engine.step_profile` records as Markdown tables (here: the report imports no torch)."""
    lines: list[str] = []
    for name, p in profiles.items():
        lines += [
            "",
            f"Step profile, {name}: step {p['step']}, {p['decode_rows']} decode rows, {p['wall_ms']:.1f} ms wall"
            + (f", {p['device_ms_total']:.1f} ms on the device" if p["device_ms_total"] else "")
            + f" (top ops by {p['ranked_by']}):",
            "",
            "| op | calls | device ms | CPU ms |",
            "|---|---|---|---|",
        ]
        lines += [
            f"| `{o['name'].replace('|', '/')}` | {o['count']} | {o['device_ms']:.2f} | {o['cpu_ms']:.2f} |"
            for o in p["ops"][:rows]
        ]
    return lines


# ---- plots -------------------------------------------------------------------------------------------
def plots(record: dict[str, Any], stem: Path) -> list[str]:
    """tok/s vs concurrency per variant, and prefill bars; [] when matplotlib is absent."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written: list[str] = []
    by_variant: dict[str, list[tuple[int, float]]] = {}
    for r in record["runs"]:
        if r.get("output_tok_s"):
            by_variant.setdefault(r["variant"], []).append((r["concurrency"], r["output_tok_s"]))
    if not by_variant:  # a scenario record: `kumo bench report` plots its rounds
        return written
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, pts in sorted(by_variant.items()):
        pts.sort()
        ax.plot([c for c, _ in pts], [t for _, t in pts], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrency")
    ax.set_ylabel("output tok/s (total)")
    ax.set_title(
        f"{record['geometry']['kind']} geometry, {record['geometry']['num_layers']} layers, {record['device']}"
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    path = stem.with_name(stem.name + "-throughput.png")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    written.append(str(path))
    prefill = [(v["variant"], v["prefill"]["prefill_tok_s"]) for v in record["variants"] if v.get("prefill")]
    if prefill:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.bar([n for n, _ in prefill], [t for _, t in prefill])
        ax.set_ylabel("prefill tok/s (one long prompt)")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
        path = stem.with_name(stem.name + "-prefill.png")
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        written.append(str(path))
    return written


def write(record: dict[str, Any], out: Path) -> list[str]:
    """`out` (.json) plus `out`.md and PNGs beside it; returns the paths written."""
    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    md = stem.with_suffix(".md")
    record["plots"] = [Path(p).name for p in plots(record, stem)]
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    md.write_text(markdown(record))
    return [str(out), str(md), *[str(stem.parent / p) for p in record["plots"]]]

"""Per-run lines of an engine bench record, to read a device call's output at a glance: the mtp
bench's A/B runs (side, wall, mean step, draft lengths, collections) or, with `--scenario`, a
scenario record's runs (variant, wall, collections). Runs recorded before `gc` was: "-".

    python3 -m lab.diagnostics.mtp_runs lab/results/<dir>/mtp-gpu.json
    python3 -m lab.diagnostics.mtp_runs --scenario lab/results/<dir>/integrity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def _gc(run: dict[str, Any]) -> str:
    g = run.get("gc")
    return f"full {g['full']} ({g['full_ms']} ms), young {g['young']} ({g['young_ms']} ms)" if g else "-"


def _kinds(run: dict[str, Any]) -> str:
    """Steps by kind: count x median ms (sum ms); runs recorded before `step_ms_by_kind`: nothing."""
    kinds = run.get("step_ms_by_kind") or {}
    return "".join(
        f"  {kind} {x['steps']}x{x['median_ms']:.3f} ({x['sum_ms']:.1f})" for kind, x in kinds.items()
    )


def mtp_lines(record: dict[str, Any]) -> list[str]:
    lines = []
    for model, m in record["models"].items():
        parts = [(f"c1 {task}", x) for task, x in m["speedup_c1"].items()]
        parts += [("c64", m["throughput_c64"])] if m.get("throughput_c64") else []
        for name, x in parts:
            lines.append(f"{model} {name}: ratios {[round(r['ratio'], 3) for r in x['rounds']]}")
            for r in (q for rd in x["rounds"] for q in rd["runs"]):
                ks = r["steps_by_draft_length"]
                lines.append(
                    f"  {r['side']} {r['wall_s']:.3f} s  {r['step_ms_mean']:.3f} ms/step  k {ks}  gc {_gc(r)}"
                    + _kinds(r)
                )
    return lines


def scenario_lines(record: dict[str, Any]) -> list[str]:
    lines = []
    for name, s in record["scenarios"].items():
        for rd in s.get("rounds", []):
            for r in rd["runs"]:
                lines.append(f"{name} {r['variant']}: {r['wall_s']:.3f} s  gc {_gc(r)}")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("record", type=Path)
    ap.add_argument("--scenario", action="store_true", help="a scenario record (kumo bench engine scenario)")
    args = ap.parse_args()
    record = json.loads(args.record.read_text())
    print("\n".join(scenario_lines(record) if args.scenario else mtp_lines(record)))


if __name__ == "__main__":
    main()

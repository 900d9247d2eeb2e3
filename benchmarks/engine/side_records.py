"""Records of one side each (`kumo bench engine scenario NAME --side A|B`, one process a side), and
the two ways they give a scenario's ratio.

    kumo bench engine combine RECORD|DIR … [--scenario NAME] --out X.json   # X.json + X.md
    kumo bench engine combine RECORD|DIR … --out-dir DIR                   # DIR/NAME.json a scenario

By process (`combine`, issue 25's full depth on one GPU): the processes, in the order they started,
ran A, B, B, A, A, B, B, A, … each built its side, warmed it on every step shape, then timed its runs.
A process's value is the mean of its complete runs' metric; each run of four processes A, B, B, A is a
round, its ratio (a1 + a2) / (b1 + b2) as the method's (`benchmarks.engine.method.round_ratio`). A
process that wrote no complete run, or four that do not read A, B, B, A, leave their round out: those
processes are named under `unpaired` (a missing one never shifts the pairs after it). The result is a
scenario record like one process's, so `kumo bench report` takes it beside the others; its
`measured_on` is the processes' geometry (78 of 78 layers at `--rank-of 8` for GLM 5.2).

`--pairs` (a device call that holds two processes a round, not four: GLM 5.2's full depth, where a
process is ~40-55 s of building and warming for ~10 s of timing): the same order A, B, B, A, A, B, …
taken two at a time, rounds (A, B), (B, A), (A, B), … each its a / b. Within a round a drift in time is
not cancelled, but its sign alternates from round to round.

The 8-GPU run's parts (`benchmarks.engine.x8`) pair their one-side processes the same way (`Pairing`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.engine import method, report

Record = dict[str, Any]


def side_entry(record: Record) -> dict[str, Any] | None:
    """The record's one-side scenario entry (None: the record is something else)."""
    entries = [e for e in (record.get("scenarios") or {}).values() if e is not None]
    return dict(entries[0]) if len(entries) == 1 and "side" in entries[0] else None


def started(record: Record) -> float:
    """When the record's process started (its clock; records before it: its date, to the second)."""
    if "started_unix_s" in record:
        return float(record["started_unix_s"])
    return datetime.datetime.fromisoformat(record["date"]).timestamp()


def in_order(records: Sequence[Record]) -> list[Record]:
    """The one-side records in the order their processes started (ties: the order given)."""
    ranked = sorted(enumerate(records), key=lambda ir: (started(ir[1]), ir[0]))
    return [r for _, r in ranked if side_entry(r) is not None]


def process_value(entry: dict[str, Any], field: str, *, extra: bool = False) -> float | None:
    """The mean of `field` over the process's complete runs (None: it completed none)."""
    values = [
        float((run.get("extra") or {})[field] if extra else run[field])
        for run in entry["runs"]
        if run["is_complete"]
    ]
    return statistics.fmean(values) if values else None


def process_rounds(
    sides: Sequence[str], values: Sequence[float | None], *, pairs: bool = False
) -> tuple[list[list[int]], list[int]]:
    """The processes (indices, in the order they ran) grouped into rounds of A, B, B, A (`pairs`:
    of one A and one B, either order) with a value each, and the ones left out: a window that is not
    such a round gives up its first process and the search goes on from the next, so one missing
    process costs its own round only."""
    rounds: list[list[int]] = []
    unpaired: list[int] = []
    size = 2 if pairs else len(method.ROUND)
    i = 0
    while i < len(sides):
        window = list(range(i, i + size))
        in_window = [sides[j] for j in window] if window[-1] < len(sides) else []
        is_round = sorted(in_window) == ["A", "B"] if pairs else in_window == list(method.ROUND)
        if is_round and all(values[j] is not None for j in window):
            rounds.append(window)
            i += len(window)
        else:
            unpaired.append(i)
            i += 1
    return rounds, unpaired


@dataclass(frozen=True)
class Pairing:
    """One-side processes, in the order they started, paired by rounds of A, B, B, A on a value each
    (`process_rounds`): each round's process indices, and those left out."""

    sides: list[str]
    values: list[float | None]
    rounds: list[list[int]]
    unpaired: list[int]

    @classmethod
    def of(
        cls, entries: Sequence[dict[str, Any]], field: str, *, extra: bool = False, pairs: bool = False
    ) -> Pairing:
        """The processes' `entries` (in the order they started) paired on their mean of `field`
        (`pairs`: rounds of two processes)."""
        sides = [e["side"] for e in entries]
        values = [process_value(e, field, extra=extra) for e in entries]
        return cls(sides, values, *process_rounds(sides, values, pairs=pairs))

    @property
    def labels(self) -> list[str]:
        """Each process by its side and place in the order: A1, B2, B3, A4, …"""
        return [f"{s}{i + 1}" for i, s in enumerate(self.sides)]

    def ratios(self, values: Sequence[float | None] | None = None) -> list[float | None]:
        """Each round's (a1 + a2) / (b1 + b2) of `values`, the processes' figures (default: the ones
        paired on); None where a process of the round has none."""
        got = self.values if values is None else values
        return [_round_ratio(idx, self.sides, got) for idx in self.rounds]

    def summary(self, values: Sequence[float | None] | None = None) -> dict[str, Any] | None:
        """The rounds' ratios of `values` as a summary entry, with the paired processes' figures by side
        and each round's processes (None: no round has a ratio)."""
        got = self.values if values is None else values
        ratios = [x for x in self.ratios(got) if x is not None]
        if not ratios:
            return None
        paired = [j for idx in self.rounds for j in idx]
        by_side = {s: [got[j] for j in paired if self.sides[j] == s] for s in ("A", "B")}
        return (
            method.summary_entry(ratios)
            | by_side
            | {"rounds": [[self.labels[j] for j in idx] for idx in self.rounds]}
        )


def _group_key(record: Record, entry: dict[str, Any]) -> str:
    g = record["geometry"]
    return json.dumps([entry["scenario"], g["kind"], g["num_layers"], g.get("rank_of", 1), entry["workload"]])


def combine(records: Sequence[Record], *, pairs: bool = False) -> Record:
    """One scenario record from one-side records of that scenario, geometry and workload, their
    processes paired by rounds (module docstring; `pairs`: rounds of two)."""
    from benchmarks.engine.scenarios import SCENARIOS, weights_beside  # torch: only when combining

    ordered = in_order(records)
    if not ordered:
        raise ValueError("no one-side scenario record (`kumo bench engine scenario NAME --side A|B`)")
    keys = {_group_key(r, side_entry(r) or {}) for r in ordered}
    if len(keys) > 1:
        raise ValueError(f"records of more than one scenario, geometry or workload: {sorted(keys)}")
    entries = [side_entry(r) or {} for r in ordered]
    name = entries[0]["scenario"]
    scenario = SCENARIOS[name]
    pairing = Pairing.of(entries, scenario.metric, pairs=pairs)
    sides, values, labels = pairing.sides, pairing.values, pairing.labels
    per_round = pairing.ratios()  # a paired process has a value
    rounds = [
        {"order": [sides[j] for j in idx], "processes": [labels[j] for j in idx],
         "runs": [run for j in idx for run in entries[j]["runs"]], "ratio": x}
        for idx, x in zip(pairing.rounds, per_round, strict=True)
    ]  # fmt: skip
    ratios = [x - 1.0 if scenario.is_overhead else x for x in per_round if x is not None]
    beside: dict[str, Any] = {}
    for field in scenario.beside:  # the same rounds' ratio of a figure the runs carry beside the metric
        extra = [process_value(e, field, extra=True) for e in entries]
        field_ratios = [x for x in pairing.ratios(extra) if x is not None]
        beside[f"{field}_ratio"] = method.summary_entry(field_ratios) if field_ratios else None
    described = {s: next(e["sides"][s] for e in entries if e["side"] == s) for s in ("A", "B") if s in sides}
    if len(described) == 2:
        beside |= weights_beside(scenario, described["A"], described["B"])
    paired = {j for idx in pairing.rounds for j in idx}
    entry = {
        "scenario": name,
        "definition": scenario.definition,
        "method": "one side a process (build, warm-up on every step shape, timed runs), processes A, B, B, A; "
        + (
            "rounds of two processes (A, B), (B, A), …, a round's ratio a / b of the processes' mean metric "
            "(a drift within a round not cancelled; its sign alternates between rounds)"
            if pairs
            else "a round's ratio (a1 + a2) / (b1 + b2) of the processes' mean metric"
        ),
        "metric": scenario.metric,
        "workload": entries[0]["workload"],
        "sides": described,
        "warm_up": {label: e["warm_up"] for label, e in zip(labels, entries, strict=True) if e["warm_up"]} or None,
        "warm_up_missed_shapes": {label: e["warm_up_missed_shapes"] for label, e in zip(labels, entries, strict=True)},
        "order": [sides[j] for idx in pairing.rounds for j in idx],
        "processes": [_process(ordered[j], entries[j], labels[j], values[j], j in paired) for j in range(len(entries))],
        "rounds": rounds,
        "unpaired": [labels[j] for j in pairing.unpaired],
        "summary": method.summary_entry(ratios) if ratios else None,
        "beside": beside,
    }  # fmt: skip
    first = ordered[0]
    machines = [r.get("machine") or {} for r in ordered]
    record = {
        "command": "kumo bench engine combine: " + "; ".join(r["command"] for r in ordered),
        "date": first["date"],
        "started_unix_s": started(first),
        "device": first["device"],
        "torch": first.get("torch"),
        "geometry": first["geometry"],
        "comparisons": [f"scenario:{name}"],
        "options": first.get("options"),
        "variants": [],
        "runs": [],
        "integrity": None,
        "transformers": None,
        "machine": {  # fresh: any process was the first benchmark process on its machine
            "is_fresh": any(m.get("is_fresh", False) for m in machines),
            "processes_fresh": [m.get("is_fresh") for m in machines],
        },
        "parallel": first.get("parallel"),
        "scenarios": {name: entry},
        "wall_s": sum(float(r.get("wall_s") or 0.0) for r in ordered),
    }
    return report.finish(record)


def _round_ratio(idx: Sequence[int], sides: Sequence[str], values: Sequence[float | None]) -> float | None:
    """(a1 + a2) / (b1 + b2) over a round's processes `idx` (None: one of them has no value)."""
    got = {j: values[j] for j in idx}
    a = [v for j, v in got.items() if sides[j] == "A" and v is not None]
    b = [v for j, v in got.items() if sides[j] == "B" and v is not None]
    return method.round_ratio(a, b) if len(a) + len(b) == len(idx) else None


def _process(
    record: Record, entry: dict[str, Any], label: str, value: float | None, is_paired: bool
) -> dict[str, Any]:
    return {
        "process": label, "side": entry["side"], "date": record["date"], "started_unix_s": started(record),
        "wall_s": record.get("wall_s"), "build_s": entry["sides"][entry["side"]].get("build_s"),
        "value": value, "runs": len(entry["runs"]), "runs_incomplete": entry.get("runs_incomplete", 0),
        "is_paired": is_paired, "is_fresh": (record.get("machine") or {}).get("is_fresh"),
        "command": record["command"],
    }  # fmt: skip


def summary_line(record: Record) -> str:
    """The combined key in one line: median [spread], the rounds, the depth, what was left out."""
    (name, entry), g = next(iter(record["scenarios"].items())), record["geometry"]
    s = entry["summary"]
    value = "no complete round" if s is None else (
        f"{s['value']:.3f} [{s['spread'][0]:.3f}, {s['spread'][1]:.3f}] from {len(s['samples'])} rounds "
        f"({', '.join(f'{x:.3f}' for x in s['samples'])})"
    )  # fmt: skip
    return (
        f"{name}: {value}; processes {' '.join(p['process'] for p in entry['processes'])}, unpaired "
        f"{entry['unpaired'] or 'none'}; {g['kind']} {g['num_layers']} of {g['full_num_layers']} layers "
        f"(rank 0 of {g.get('rank_of', 1)})"
    )


def load(paths: Sequence[Path], scenario: str | None = None) -> list[Record]:
    """The one-side records among `paths` (a folder: its *.json), of `scenario` if named."""
    files = [f for p in paths for f in (sorted(p.glob("*.json")) if p.is_dir() else [p])]
    out = []
    for f in files:
        record = json.loads(f.read_text())
        entry = side_entry(record) if isinstance(record, dict) else None
        if entry is not None and scenario in (None, entry["scenario"]):
            out.append(record)
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kumo bench engine combine", description=__doc__.splitlines()[0])
    ap.add_argument("records", nargs="+", type=Path, help="one-side records, or folders of them")
    ap.add_argument("--scenario", default=None, help="only that scenario's records")
    ap.add_argument("--pairs", action="store_true", help="rounds of two processes, (A, B), (B, A), …")
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--out", type=Path, help="the scenario record (.json; .md beside it)")
    where.add_argument("--out-dir", type=Path, help="one record per scenario there, DIR/NAME.json")
    a = ap.parse_args(argv)
    records = load(a.records, a.scenario)
    by_name: dict[str, list[Record]] = {}
    for r in records:
        by_name.setdefault((side_entry(r) or {})["scenario"], []).append(r)
    if a.out is not None and len(by_name) > 1:
        ap.error(
            f"records of {len(by_name)} scenarios ({', '.join(sorted(by_name))}): --scenario or --out-dir"
        )
    lines = []
    for name, group in by_name.items() or [("", [])]:
        try:
            record = combine(group, pairs=a.pairs)
        except ValueError as exc:
            raise SystemExit(f"kumo bench engine combine: {exc}") from exc
        paths = report.write(record, a.out or a.out_dir / f"{name}.json")
        print(report.markdown(record))
        print("wrote " + ", ".join(paths))
        lines.append(summary_line(record))
    print("\n".join(lines))  # the combined keys last, one line each
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

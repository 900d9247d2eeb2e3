"""`kumo bench engine combine` (benchmarks/engine/side_records.py): one-side processes A, B, B, A
paired by rounds in the order they started, a missing or cut process costing its own round only, and
the combined record chosen by `kumo bench report` over a truncated one of the same key."""

from __future__ import annotations

import copy
import json
import random
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks import report as bench_report
from benchmarks.engine import report, side_records
from benchmarks.engine.geometry import make_geometry

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
TRUNCATED = (
    RESULTS / "2026-12-04-rank-of-8-int4-vs-fp8-decode-c1.json"
)  # 50 of 78 layers, both in one process
NAME = "int4_vs_fp8_decode_c1"
WORKLOAD = {
    "concurrency": 1,
    "input_len": 2048,
    "output_len": 256,
    "chunk": 2048,
    "page_size": 16,
    "pool_scale": 0.1,
}
FULL = make_geometry("glm-5.2", None, rank_of=8).describe()  # 78 of 78 layers, rank 0 of 8


def one_side(side: str, values: list[float], start: float, *, complete: bool = True) -> dict[str, Any]:
    """A record as `kumo bench engine scenario NAME --side SIDE --rank-of 8` writes one."""
    described = json.loads(TRUNCATED.read_text())["scenarios"][NAME]["sides"][side]
    runs = [
        {"variant": f"{NAME}/{described['label']}/{i}", "side": side, "is_complete": complete,
         "output_tok_s_per_user": v, "output_tok_s": v}
        for i, v in enumerate(values)
    ]  # fmt: skip
    return {
        "command": f"kumo bench engine scenario {NAME} --side {side} --rank-of 8 ({start})",
        "date": f"2026-12-05T10:{int(start) // 60:02d}:{int(start) % 60:02d}+00:00",
        "started_unix_s": 1_800_000_000.0 + start,
        "device": "NVIDIA H200",
        "geometry": copy.deepcopy(FULL),
        "options": {"side": side},
        "machine": {"is_fresh": start == 0, "compile_cache_entries_at_start": 0},
        "parallel": {"tp": 1, "ep": 8, "dcp": 1, "layout": "rank 0 of 8, alone (collectives local)"},
        "wall_s": 50.0,
        "scenarios": {NAME: {
            "scenario": NAME, "definition": "…", "side": side, "metric": "output_tok_s_per_user",
            "workload": dict(WORKLOAD), "sides": {side: described},
            "warm_up": {"s": 10.0, "num_step_shapes": 2}, "warm_up_missed_shapes": [], "runs": runs,
            "runs_incomplete": 0 if complete else len(runs), "summary": None,
        }},
    }  # fmt: skip


def processes(*specs: tuple[str, list[float]]) -> list[dict[str, Any]]:
    """One record a (side, values), started 60 s apart in the order given."""
    return [one_side(side, values, 60.0 * i) for i, (side, values) in enumerate(specs)]


def ratio(a: list[list[float]], b: list[list[float]]) -> float:
    """A round's ratio: the sum of A's process means over the sum of B's."""
    return sum(statistics.fmean(x) for x in a) / sum(statistics.fmean(x) for x in b)


def test_processes_pair_in_the_order_they_started_not_the_order_given() -> None:
    records = processes(("A", [40.0, 42.0]), ("B", [38.0]), ("B", [37.0]), ("A", [41.0]),
                        ("A", [50.0]), ("B", [25.0]), ("B", [24.0]), ("A", [49.0]))  # fmt: skip
    shuffled = records[:]
    random.Random(3).shuffle(shuffled)
    record = side_records.combine(shuffled)
    entry = record["scenarios"][NAME]
    assert entry["order"] == ["A", "B", "B", "A"] * 2
    assert [p["process"] for p in entry["processes"]] == ["A1", "B2", "B3", "A4", "A5", "B6", "B7", "A8"]
    expected = [ratio([[40.0, 42.0], [41.0]], [[38.0], [37.0]]), ratio([[50.0], [49.0]], [[25.0], [24.0]])]
    assert [r["ratio"] for r in entry["rounds"]] == pytest.approx(expected)
    assert entry["summary"]["samples"] == pytest.approx(expected)
    assert entry["summary"]["value"] == pytest.approx(statistics.median(expected))
    assert entry["summary"]["spread"] == pytest.approx([min(expected), max(expected)])
    assert entry["unpaired"] == [] and [r["processes"] for r in entry["rounds"]][1] == [
        "A5",
        "B6",
        "B7",
        "A8",
    ]
    assert record["geometry"]["num_layers"] == record["geometry"]["full_num_layers"] == 78
    assert record["machine"]["is_fresh"] and record["machine"]["processes_fresh"] == [True] + [False] * 7
    assert (
        record["summary"][NAME] == entry["summary"]
    )  # the record's summary, as `kumo bench report` reads it
    assert entry["beside"]["bytes_ceiling_full_depth"] == pytest.approx(
        entry["sides"]["B"]["full_depth_weight_bytes_per_gpu"]
        / entry["sides"]["A"]["full_depth_weight_bytes_per_gpu"]
    )
    assert "| 2 | A |" in report.markdown(record)  # the report's own table of the rounds


def test_a_missing_process_costs_its_own_round_only() -> None:
    """Round 2's first A never wrote a record: rounds 1 and 3 pair, round 2's three are unpaired (a
    pairing by count would have divided every later A by the B before it)."""
    specs = [("A", [10.0]), ("B", [5.0]), ("B", [5.0]), ("A", [10.0]),
             ("A", [99.0]), ("B", [9.0]), ("B", [9.0]), ("A", [12.0]),
             ("A", [30.0]), ("B", [10.0]), ("B", [10.0]), ("A", [30.0])]  # fmt: skip
    records = processes(*specs)
    del records[4]
    entry = side_records.combine(records)["scenarios"][NAME]
    assert [r["processes"] for r in entry["rounds"]] == [["A1", "B2", "B3", "A4"], ["A8", "B9", "B10", "A11"]]
    assert entry["unpaired"] == ["B5", "B6", "A7"]
    assert entry["summary"]["samples"] == pytest.approx([20.0 / 10.0, 60.0 / 20.0])
    assert [p["is_paired"] for p in entry["processes"]] == [True] * 4 + [False] * 3 + [True] * 4


def test_a_process_without_a_complete_run_breaks_its_round() -> None:
    records = processes(("A", [10.0]), ("B", [5.0]), ("B", [5.0]), ("A", [10.0]), ("A", [8.0]), ("B", [4.0]))
    records[2] = one_side("B", [5.0], 120.0, complete=False)  # cut at its deadline
    entry = side_records.combine(records)["scenarios"][NAME]
    assert entry["rounds"] == [] and entry["summary"] is None
    assert entry["unpaired"] == ["A1", "B2", "B3", "A4", "A5", "B6"]
    assert entry["processes"][2]["value"] is None


def test_process_rounds_find_every_a_b_b_a_run() -> None:
    sides = list("ABBAABBABBAABBA")
    values: list[float | None] = [1.0] * len(sides)
    rounds, unpaired = side_records.process_rounds(sides, values)
    assert rounds == [[0, 1, 2, 3], [4, 5, 6, 7], [11, 12, 13, 14]]  # "B B A A" is no round
    assert unpaired == [8, 9, 10]
    values[1] = None
    assert side_records.process_rounds(sides, values)[0] == [[4, 5, 6, 7], [11, 12, 13, 14]]


def test_pairs_take_the_same_order_two_processes_a_round() -> None:
    """`--pairs` (one call's worth of GLM 5.2 processes): A, B, B, A, A, B is three rounds, (A, B),
    (B, A), (A, B), each a / b; a process without a value costs its own pair only."""
    records = processes(("A", [40.0, 42.0]), ("B", [20.0]), ("B", [21.0]), ("A", [44.0]),
                        ("A", [30.0]), ("B", [10.0]))  # fmt: skip
    entry = side_records.combine(records, pairs=True)["scenarios"][NAME]
    assert [r["processes"] for r in entry["rounds"]] == [["A1", "B2"], ["B3", "A4"], ["A5", "B6"]]
    assert entry["summary"]["samples"] == pytest.approx([41.0 / 20.0, 44.0 / 21.0, 3.0])
    assert "rounds of two processes" in entry["method"]
    sides = list("ABBAABAA")
    values: list[float | None] = [1.0] * len(sides)
    values[2] = None
    rounds, unpaired = side_records.process_rounds(sides, values, pairs=True)
    assert rounds == [[0, 1], [4, 5]]
    assert unpaired == [2, 3, 6, 7]  # no value; then A, A twice (and the last alone)
    assert side_records.process_rounds(sides, [1.0] * 8)[0] == [[0, 1, 2, 3]]  # A, B, B, A rounds unchanged


def test_records_of_two_workloads_do_not_combine() -> None:
    records = processes(("A", [1.0]), ("B", [1.0]))
    records[1]["scenarios"][NAME]["workload"]["input_len"] = 1024
    with pytest.raises(ValueError, match="more than one scenario, geometry or workload"):
        side_records.combine(records)


def test_the_report_takes_the_full_depth_record_over_the_truncated_one(tmp_path: Path) -> None:
    """`kumo bench report --results`: the one-side records are not summary records; the combined one
    is, and it wins the key over the committed 50-layer record (the same workload, deeper), with its
    depth and slice in the table."""
    records = processes(("A", [40.0]), ("B", [38.0]), ("B", [38.0]), ("A", [40.0]))
    combined = side_records.combine(records)
    truncated = json.loads(TRUNCATED.read_text())
    assert truncated["geometry"]["num_layers"] == 50 and truncated["summary"][NAME] is not None
    for i, r in enumerate(records):
        (tmp_path / f"p{i}.json").write_text(json.dumps(r))
    report.write(combined, tmp_path / "combined.json")
    (tmp_path / TRUNCATED.name).write_text(TRUNCATED.read_text())
    engine, _ = bench_report.find_records(tmp_path)
    assert sorted(name for name, _ in engine) == sorted(["combined.json", TRUNCATED.name])
    for order in (engine, engine[::-1]):
        merged = report.merge([r for _, r in order])
        chosen = merged["scenarios"][NAME]
        assert chosen["measured_on"]["layers"] == 78 and chosen["measured_on"]["rank_of"] == 8
        assert merged["summary"][NAME] == combined["summary"][NAME]
        assert chosen["not_pooled"] == [truncated["command"]]
    table = bench_report.summary_table(report.merge([r for _, r in engine]), [n for n, _ in engine])
    (row,) = [line for line in table.splitlines() if line.startswith(f"| `{NAME}`")]
    assert "glm-5.2, 78 of 78 layers (rank 0 of 8), 1 x 2,048 / 256 tokens" in row and "| 1.05x |" in row


def test_a_figure_beside_the_metric_gets_the_same_rounds() -> None:
    """fp8kv_vs_bf16kv_long_c64 records its steady-decode ratio beside the end-to-end one."""
    long = "fp8kv_vs_bf16kv_long_c64"
    steady = {"A": [6.0, 6.4], "B": [4.0, 4.4]}
    records = processes(("A", [3.0]), ("B", [2.0]), ("B", [2.0]), ("A", [3.0]))
    for r in records:
        entry = r["scenarios"].pop(NAME)
        entry["scenario"] = long
        for run in entry["runs"]:
            run["extra"] = {"steady_decode_tok_s": steady[entry["side"]].pop(0)}
        r["scenarios"][long] = entry
    entry = side_records.combine(records)["scenarios"][long]
    assert entry["summary"]["samples"] == pytest.approx([6.0 / 4.0])
    assert entry["beside"]["steady_decode_tok_s_ratio"]["samples"] == pytest.approx([12.4 / 8.4])
    assert "bytes_ceiling" not in entry["beside"]  # both sides INT4 experts: no weight bytes to compare

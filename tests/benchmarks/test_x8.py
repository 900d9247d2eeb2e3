"""benchmarks/x8.sh, the 8-GPU run (issue 23): its CPU rehearsal, every part on a real group of two
ranks over gloo at the tiny geometry (`kumo bench engine scenario … --tp 2`), its combined record,
and its refusal to run on fewer than 8 GPUs.

The rehearsal runs as the script does, in its own processes: joining a process group is for the life
of a process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.engine import x8
from benchmarks.engine.scenario_cli import parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "x8.sh"


def _env(**extra: str) -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHON=sys.executable, **extra)


@pytest.fixture(scope="module")
def rehearsal(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("x8")
    cache = tmp_path_factory.mktemp("triton")
    done = subprocess.run(
        ["bash", str(SCRIPT), "rehearse"], cwd=ROOT, env=_env(OUT=str(out), COMPILE_CACHE=str(cache)),
        capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "# The 8-GPU run (issue 23)" in done.stdout  # the summary table is printed
    return out


def _stage_records(out: Path) -> list[tuple[Path, dict[str, Any]]]:
    return [(p, json.loads(p.read_text())) for p in sorted(out.glob("*.json")) if x8.stage_of(p)]


@pytest.mark.slow
def test_every_part_ran_on_two_ranks_and_the_follower_ran_every_step(rehearsal: Path) -> None:
    records = _stage_records(rehearsal)
    stages = {x8.stage_of(p) for p, _ in records}
    assert stages == set(x8.STAGES)
    for path, record in records:
        assert record["parallel"]["tp"] == 2 and record["parallel"]["layout"] == "a real group of 2 ranks"
        assert record["follower_exit_codes"] == [0], path.name
        sent = record["steps_sent_to_followers"]
        log = path.with_suffix(".log").read_text()
        followed = [int(n) for n in re.findall(r"rank 1 followed (\d+) steps", log)]
        assert sent > 0 and followed == [sent], (path.name, sent, followed)
        (entry,) = record["scenarios"].values()
        assert entry["summary"] is not None, path.name
    for p, r in records:  # the long workload warms up on shorter lengths, the shapes it missed listed
        if x8.stage_of(p) == "kv-long":
            (entry,) = r["scenarios"].values()
            assert entry["warm_up"]["lengths"] == [16, 4]
            assert isinstance(entry["warm_up_missed_shapes"], list)
            assert entry["workload"]["input_len"] == 24 and entry["runs"][0]["output_tokens"] == 4 * 6
    dcp = [r for p, r in records if x8.stage_of(p) == "kv-capacity-dcp8"]
    assert {r["parallel"]["dcp"] for r in dcp} == {2}
    for r in dcp:  # a page holds page_size tokens on each of the 2 DCP ranks
        (entry,) = r["scenarios"].values()
        assert entry["sides"][entry["side"]]["kv_capacity_tokens"] % (16 * 2) == 0


@pytest.mark.slow
def test_the_combined_record_divides_each_side_s_runs_in_order(rehearsal: Path) -> None:
    (path,) = [p for p in rehearsal.glob("*-x8.json")]
    combined = json.loads(path.read_text())
    assert path.with_suffix(".md").exists()
    assert set(combined["summary"]) == set(x8.SUMMARY_KEYS)
    records = _stage_records(rehearsal)
    for stage, (key, field) in x8.RATIO_STAGES.items():  # one round a stage: A, B, B, A
        ran = sorted((r["started_unix_s"], r) for p, r in records if x8.stage_of(p) == stage)
        means: dict[str, list[float]] = {"A": [], "B": []}
        for _, r in ran:
            (entry,) = r["scenarios"].values()
            done = [run[field] for run in entry["runs"] if run["is_complete"]]
            means[entry["side"]].append(sum(done) / len(done))
        assert [next(iter(r["scenarios"].values()))["side"] for _, r in ran] == ["A", "B", "B", "A"], stage
        got = combined["summary"].get(key) or combined["beside"].get(key)
        assert got["samples"] == pytest.approx([sum(means["A"]) / sum(means["B"])]), key
        assert got["rounds"] == [["A1", "B2", "B3", "A4"]]
    assert combined["unpaired"] == {}
    (tags,) = [r for p, r in records if x8.stage_of(p) == "tags"]
    (entry,) = tags["scenarios"].values()
    assert combined["summary"]["integrity_overhead"]["samples"] == pytest.approx(
        [rnd["ratio"] - 1 for rnd in entry["rounds"]]
    )
    assert [row["concurrency"] for row in combined["load"]] == [1, 4]
    for row in combined["load"]:
        assert row["runs"] >= 1 and row["ttft_ms_p50"] <= row["ttft_ms_p99"]
        assert row["tpot_ms_p50"] <= row["tpot_ms_p99"]
    assert combined["load"][1]["over_vllm"] == pytest.approx(combined["load"][1]["tok_s_per_user"] / 91.2)
    assert {row["step"] for row in combined["comms"]} >= {"decode"}
    for row in combined["comms"]:  # on the CPU: gloo's own CPU time, a part of the step's wall time
        assert 0 < row["collective_share_of_wall"] < 1


def _fake_nvidia_smi(folder: Path, gpus: int) -> dict[str, str]:
    tool = folder / "nvidia-smi"
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'\n" for i in range(gpus))
    tool.write_text(f"#!/bin/sh\n{lines}")
    tool.chmod(0o755)
    return _env(PATH=f"{folder}:{os.environ['PATH']}", OUT=str(folder / "out"))


@pytest.mark.parametrize("gpus", [0, 1, 7])
def test_it_refuses_fewer_than_eight_gpus(tmp_path: Path, gpus: int) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), "glm-decode", "A"], cwd=ROOT, env=_fake_nvidia_smi(tmp_path, gpus),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"needs 8 GPUs on one host (TP8 / EP8); nvidia-smi -L lists {gpus}" in done.stderr
    assert "RANK_OF=8 bash benchmarks/x8.sh glm-decode A" in done.stderr
    assert not list((tmp_path / "out").glob("*.json"))


def test_a_part_takes_its_argument(tmp_path: Path) -> None:
    done = subprocess.run(
        ["bash", str(SCRIPT), "load", "many"], cwd=ROOT, env=_fake_nvidia_smi(tmp_path, 8),
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 2 and "load takes a concurrency (got 'many')" in done.stderr


def test_tp_and_rank_of_exclude_each_other() -> None:
    from benchmarks.engine.scenario_cli import main

    assert parser().parse_args(["integrity_overhead", "--tp", "8"]).tp == 8
    with pytest.raises(SystemExit, match="exclude each other"):
        main(["integrity_overhead", "--tp", "2", "--rank-of", "2"])
    with pytest.raises(SystemExit, match="must divide"):
        main(["integrity_overhead", "--tp", "8", "--dcp", "3"])


def _side_record(stage: str, side: str, values: list[float], start: float) -> tuple[str, dict[str, Any]]:
    """(stage, record) as `x8.sh STAGE SIDE` writes one: a one-side scenario record, its timed runs."""
    key, field = x8.RATIO_STAGES[stage]
    runs = [{"is_complete": True, field: v, "extra": {"steady_decode_tok_s": 2 * v}} for v in values]
    entry = {"scenario": key, "side": side, "runs": runs, "workload": {"concurrency": 1}}
    record = {"command": f"{stage} {side}", "date": "2026-12-05T10:00:00+00:00", "device": "cpu",
              "started_unix_s": 1_800_000_000.0 + start, "scenarios": {key: entry}}  # fmt: skip
    return stage, record


def test_the_ratio_stages_pair_their_processes_by_rounds() -> None:
    """Processes A, B, B, A, A, B, B, A by when they started (not the order given): a round's ratio
    is the sum of A's process means over B's."""
    specs = [("A", [10.0, 12.0]), ("B", [5.0]), ("B", [6.0]), ("A", [11.0]),
             ("A", [30.0]), ("B", [10.0]), ("B", [20.0]), ("A", [30.0])]  # fmt: skip
    records = [_side_record("glm-decode", side, v, 60.0 * i) for i, (side, v) in enumerate(specs)]
    got = x8.combine(records[::-1])["summary"]["int4_vs_fp8_decode_c1"]
    expected = [(11.0 + 11.0) / (5.0 + 6.0), (30.0 + 30.0) / (10.0 + 20.0)]
    assert got["samples"] == pytest.approx(expected)
    assert got["value"] == pytest.approx(2.0) and got["spread"] == pytest.approx([2.0, 2.0])
    assert got["A"] == pytest.approx([11.0, 11.0, 30.0, 30.0]) and got["B"] == pytest.approx([5, 6, 10, 20])
    assert got["rounds"] == [["A1", "B2", "B3", "A4"], ["A5", "B6", "B7", "A8"]]


def test_a_missing_run_costs_its_own_round_only() -> None:
    """Round 2's first A never wrote a record: rounds 1 and 3 keep their pairs, round 2's other three
    are named unpaired (pairing the i-th A with the i-th B would have shifted every later pair)."""
    specs = [("A", [10.0]), ("B", [5.0]), ("B", [5.0]), ("A", [10.0]),
             ("A", [99.0]), ("B", [9.0]), ("B", [9.0]), ("A", [12.0]),
             ("A", [30.0]), ("B", [10.0]), ("B", [10.0]), ("A", [30.0])]  # fmt: skip
    records = [_side_record("kv-long", side, v, 60.0 * i) for i, (side, v) in enumerate(specs)]
    del records[4]
    combined = x8.combine(records)
    got = combined["summary"]["fp8kv_vs_bf16kv_long_c64"]
    assert got["samples"] == pytest.approx([20.0 / 10.0, 60.0 / 20.0])
    assert got["rounds"] == [["A1", "B2", "B3", "A4"], ["A8", "B9", "B10", "A11"]]
    steady = combined["beside"]["fp8kv_vs_bf16kv_long_c64_steady_decode"]  # the same rounds
    assert steady["samples"] == pytest.approx([40.0 / 20.0, 120.0 / 40.0])
    assert combined["unpaired"] == {"kv-long": ["B5", "B6", "A7"]}
    assert "kv-long: processes B5, B6, A7 in no A, B, B, A round, left out." in x8.markdown(combined)


def test_a_stage_with_no_whole_round_is_not_measured_and_says_why() -> None:
    records = [
        _side_record("kv-capacity", side, [v], 60.0 * i)
        for i, (side, v) in enumerate([("A", 4.0), ("B", 2.0)])
    ]
    combined = x8.combine(records)
    assert combined["summary"]["capacity_fp8_over_bf16"] is None
    assert combined["unpaired"] == {"kv-capacity": ["A1", "B2"]}
    assert "| capacity_fp8_over_bf16 | not measured |" in x8.markdown(combined)


def test_stage_of_takes_the_longest_stage_name() -> None:
    assert x8.stage_of(Path("kv-capacity-dcp8-A-101010.json")) == "kv-capacity-dcp8"
    assert x8.stage_of(Path("kv-capacity-B-101010.json")) == "kv-capacity"
    assert x8.stage_of(Path("2026-12-04-x8.json")) == ""

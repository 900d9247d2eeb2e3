"""lab/device/r7_full_depth.sh, checked on the CPU before a device call spends its minutes: its
commands measure GLM 5.2 at 78 of 78 layers (rank 0 of 8), one side a process in the order A, B, B, A,
within the call's 540 s by their estimates; a second call resumes at the next round; and at tiny
scale two calls' records combine into one record of both calls' rounds."""

from __future__ import annotations

import json
import os
import shlex
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.scenario_cli import parser as scenario_parser
from benchmarks.engine.scenarios import SCENARIOS
from benchmarks.engine.side_records import main as combine_main

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "lab" / "device" / "r7_full_depth.sh"
LIMIT, EXIT_S = 540, 20
DECODE, PREFILL = "int4_vs_fp8_decode_c1", "int4_vs_fp8_prefill"


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=600,
        env=dict(os.environ, OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"), **env),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def planned(tmp_path: Path, **env: str) -> list[list[str]]:
    """The commands the script would run on the device (DRY=1 prints them, one a line)."""
    out = run(tmp_path, DRY="1", PRIOR=str(tmp_path / "none"), **env).stdout
    return [shlex.split(line) for line in out.splitlines() if not line.startswith("==")]


def test_the_first_call_runs_two_decode_rounds_of_processes_a_b_b_a_at_full_depth(tmp_path: Path) -> None:
    *processes, combine = planned(tmp_path)
    parsed = [scenario_parser().parse_args(argv[5:]) for argv in processes]
    assert [a.name for a in parsed] == [DECODE] * 8
    assert [a.side for a in parsed] == ["A", "B", "B", "A"] * 2
    assert [Path(a.out).name for a in parsed][:4] == [
        f"{DECODE}-r1-p{k}-{s}.json" for k, s in enumerate("ABBA", 1)
    ]
    for a in parsed:
        geometry = make_geometry(SCENARIOS[a.name].kind, a.layers, rank_of=a.rank_of)
        assert (a.rank_of, geometry.num_layers, geometry.full_num_layers) == (8, 78, 78)
        assert not a.tiny and not a.experts_only and a.cuda_graphs and a.warm_up and a.warm_up_lengths is None
        assert a.concurrency is a.input_len is a.output_len is None  # the scenario's own point
        assert a.rounds == 1 and a.budget_s <= LIMIT - EXIT_S
    assert combine[3:5] == ["engine", "combine"]


def test_pairs_run_two_processes_a_round_and_combine_by_pairs(tmp_path: Path) -> None:
    """PAIRS=1: the same process order (A, B, B, A, A, B), two a round, so the three decode rounds and
    two prefill rounds are planned in one call; the combine is told `--pairs`."""
    *processes, combine = planned(tmp_path, PAIRS="1")
    parsed = [scenario_parser().parse_args(argv[5:]) for argv in processes]
    assert [(a.name, a.side) for a in parsed] == [(DECODE, s) for s in "ABBAAB"] + [
        (PREFILL, s) for s in "ABBA"
    ]
    assert [Path(a.out).name for a in parsed][:3] == [
        f"{DECODE}-r1-p1-A.json", f"{DECODE}-r1-p2-B.json", f"{DECODE}-r2-p1-B.json"
    ]  # fmt: skip
    assert combine[3:5] == ["engine", "combine"] and combine[-1] == "--pairs"


def test_a_second_call_starts_at_the_next_round_then_prefill(tmp_path: Path) -> None:
    prior = tmp_path / "prior" / "records"
    prior.mkdir(parents=True)
    for r in (1, 2):
        for k, side in enumerate("ABBA", 1):
            (prior / f"{DECODE}-r{r}-p{k}-{side}.json").write_text("{}")
    (prior / f"{PREFILL}-r1-p1-A.json").write_text("{}")  # a round cut short: not counted
    done = run(tmp_path, DRY="1", PRIOR=str(tmp_path / "prior"))
    lines = [shlex.split(x) for x in done.stdout.splitlines() if not x.startswith("==")]
    parsed = [scenario_parser().parse_args(argv[5:]) for argv in lines[:-1]]
    assert [(a.name, Path(a.out).name.split("-")[1]) for a in parsed] == [(DECODE, "r3")] * 4 + [
        (PREFILL, "r1")
    ] * 4 + [(PREFILL, "r2")] * 4
    assert all(a.rounds == 3 for a in parsed if a.name == PREFILL)
    assert f"== {PREFILL} round 3: left for the next call" in done.stdout


def test_a_round_that_would_overrun_the_call_is_left_for_the_next(tmp_path: Path) -> None:
    """LIMIT 300: 20 s of preamble, a 200 s decode round, 65 s left, no second round, no prefill."""
    lines = planned(tmp_path, LIMIT="300")
    assert len(lines) == 4 + 1


@pytest.mark.slow
def test_at_tiny_scale_two_calls_combine_into_one_record(tmp_path: Path) -> None:
    env = {"TINY": "1", "PYTHON": sys.executable, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
           "COMPILE_CACHE": str(tmp_path / "cache")}  # fmt: skip
    first = run(tmp_path / "1", ROUNDS="1", PRIOR=str(tmp_path / "none"), **env)
    assert f"{DECODE}: " in first.stdout and f"{PREFILL}: " in first.stdout
    assert sorted(p.name for p in (tmp_path / "1" / "out").iterdir()) == ["r7_full_depth.tgz"]
    prior = tmp_path / "prior"
    with tarfile.open(tmp_path / "1" / "out" / "r7_full_depth.tgz") as tar:
        tar.extractall(prior, filter="data")
    second = run(tmp_path / "2", ROUNDS="2", ONLY=DECODE, PRIOR=str(prior), **env)
    assert "== prior: 8 records" in second.stdout and f"{DECODE}-r2-p4-A rc=0" in second.stdout
    with tarfile.open(tmp_path / "2" / "out" / "r7_full_depth.tgz") as tar:
        tar.extractall(tmp_path / "back", filter="data")
    record = json.loads((tmp_path / "back" / "combined" / f"{DECODE}.json").read_text())
    entry = record["scenarios"][DECODE]
    assert entry["order"] == ["A", "B", "B", "A"] * 2 and entry["unpaired"] == []
    assert len(entry["summary"]["samples"]) == 2 and len({p["command"] for p in entry["processes"]}) == 8
    assert entry["warm_up_missed_shapes"] == {p["process"]: [] for p in entry["processes"]}
    raw = sorted(
        (json.loads(p.read_text()) for p in (tmp_path / "back" / "records").glob(f"{DECODE}-*.json")),
        key=lambda r: r["started_unix_s"],
    )
    per_process = [
        (e["side"], statistics.fmean(run["output_tok_s_per_user"] for run in e["runs"]))
        for r in raw
        for e in r["scenarios"].values()
    ]
    for i, sample in enumerate(entry["summary"]["samples"]):  # (a1 + a2) / (b1 + b2) per round
        round_ = per_process[4 * i : 4 * i + 4]
        assert [s for s, _ in round_] == ["A", "B", "B", "A"]
        assert sample == pytest.approx(
            sum(v for s, v in round_ if s == "A") / sum(v for s, v in round_ if s == "B")
        )
    # the command the script runs, again by hand over the same records: the same summary
    assert (
        combine_main(
            [str(tmp_path / "back" / "records"), "--scenario", DECODE, "--out", str(tmp_path / "again.json")]
        )
        == 0
    )
    assert json.loads((tmp_path / "again.json").read_text())["summary"][DECODE] == record["summary"][DECODE]

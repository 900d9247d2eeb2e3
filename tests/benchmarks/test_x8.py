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
    for stage, (key, field) in x8.RATIO_STAGES.items():
        sides: dict[str, list[float]] = {"A": [], "B": []}
        for p, r in records:
            if x8.stage_of(p) == stage:
                (entry,) = r["scenarios"].values()
                sides[entry["side"]] += [run[field] for run in entry["runs"] if run["is_complete"]]
        expected = [a / b for a, b in zip(sides["A"], sides["B"], strict=False)]
        got = combined["summary"].get(key) or combined["beside"].get(key)
        assert expected and got["samples"] == pytest.approx(expected), key
        assert got["value"] == pytest.approx(sorted(expected)[len(expected) // 2])
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


def test_paired_ratio_pairs_the_runs_in_the_order_they_ran() -> None:
    def entry(side: str, values: list[float], complete: bool = True) -> dict[str, Any]:
        return {"side": side, "runs": [{"m": v, "is_complete": complete} for v in values]}

    got = x8.paired_ratio(
        [entry("A", [10.0, 12.0]), entry("B", [5.0]), entry("B", [4.0, 99.0], complete=False),
         entry("B", [3.0]), entry("A", [9.0])],
        "m",
    )  # fmt: skip
    assert got is not None
    assert got["samples"] == pytest.approx([2.0, 4.0])  # A 10, 12, 9 over B 5, 3 (the cut run left out)
    assert got["value"] == pytest.approx(3.0) and got["spread"] == pytest.approx([2.0, 4.0])
    assert x8.paired_ratio([entry("A", [1.0])], "m") is None
    assert x8.stage_of(Path("kv-capacity-dcp8-A-101010.json")) == "kv-capacity-dcp8"
    assert x8.stage_of(Path("kv-capacity-B-101010.json")) == "kv-capacity"
    assert x8.stage_of(Path("2026-12-04-x8.json")) == ""

"""lab/device/r9_c1_rank_of.sh, checked on the CPU before a device call spends its minutes: its
commands measure decode-c1 at rank 0 of 8 and GLM 5.2's full depth, INT4 then FP8 every Linear, 3
rounds each, inside the call's 540 s; and at tiny scale the script runs them and merges the two
records into one under the rank-of key."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

from benchmarks.engine.decode_c1 import SUMMARY_KEY, depths, parser

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "lab" / "device" / "r9_c1_rank_of.sh"
LIMIT, PREAMBLE_S, EXIT_S, MERGE_S = 540, 25, 30, 15  # the script's, the preamble ~15-25 s


def run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        ["bash", str(SCRIPT)], cwd=ROOT, capture_output=True, text=True, timeout=300,
        env=dict(os.environ, OUT=str(tmp_path / "out"), LOGS=str(tmp_path / "logs"), OMP_NUM_THREADS="1", **env),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


def test_the_device_commands_run_rank_0_of_8_at_full_depth_within_the_call(tmp_path: Path) -> None:
    lines = [shlex.split(x) for x in run(tmp_path, DRY="1").stdout.splitlines() if not x.startswith("==")]
    *formats, merge = lines
    parsed = [parser().parse_args(argv[5:]) for argv in formats]
    assert [a.formats for a in parsed] == ["int4-all", "fp8-all"]
    for a in parsed:
        assert a.rank_of == 8 and depths(a) == (78, 78, 78) and a.rounds == 3 and not a.tiny
    # worst case, each process to its timeout: the script cuts the second's budget to what is left,
    # still twice its estimate (~75 s), and the call ends inside its 540 s
    first = PREAMBLE_S + parsed[0].budget_s + EXIT_S
    second = min(parsed[1].budget_s, LIMIT - first - EXIT_S - MERGE_S)
    assert second >= 150 and first + second + EXIT_S + MERGE_S <= LIMIT
    assert merge[3:6] == ["engine", "decode-c1", "--merge"]
    assert merge[6:8] == [str(a.out) for a in parsed]


def test_the_tiny_dry_run_merges_both_formats_under_the_rank_of_key(tmp_path: Path) -> None:
    run(tmp_path, TINY="1", PYTHON=sys.executable)
    with tarfile.open(tmp_path / "out" / "r9_c1_rank_of.tgz") as tar:
        merged = json.load(tar.extractfile("./decode-c1-rank-of-2.json"))  # type: ignore[arg-type]
    key = f"{SUMMARY_KEY}_rank_of_2"
    assert list(merged["formats"]) == ["int4-all", "fp8-all"] and len(merged["sources"]) == 2
    assert merged["summary"] == {key: merged["formats"][merged["worst_format"]]["summary"]}
    assert (
        merged["with_modelled_nvlink"][f"{key}_with_modelled_nvlink"]["value"]
        > merged["summary"][key]["value"]
    )

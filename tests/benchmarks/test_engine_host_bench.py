"""`kumo bench engine host` at toy sizes: the record says what it measured, and the counts add up."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.cli import main as bench_main


def test_host_bench_writes_a_record(tmp_path: Path) -> None:
    out = tmp_path / "host.json"
    args = ["--batch-sizes", "1,3", "--steps", "4", "--repeats", "2", "--prompt-len", "20"]
    args += ["--profile-batch", "3"]
    assert bench_main(["engine", "host", *args, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["command"].startswith("kumo bench engine host")
    assert {(r["sampling"], r["batch_size"]) for r in rec["runs"]} == {
        (m, b) for m in ("greedy", "sampled") for b in (1, 3)
    }
    for run in rec["runs"]:
        assert run["timed_steps"] == 8 and run["graph_replays"] >= 8  # every timed step is a decode replay
        assert run["host_ms_median"] > 0 and run["python_calls_per_step"] > 0
        assert bool(run["profile"]) == (run["batch_size"] == 3)
        assert run["async_host_ms_median"] > 0  # through AsyncEngine and the output processor too

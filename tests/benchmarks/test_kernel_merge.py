"""Merging kernel-benchmark records into kernels-h200.json: every run kept, newest row per case."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.kernels.merge import main, merge


def _record(date: str, copy: float, rows: list[tuple[str, str, float]]) -> dict:
    return {"command": f"bench {date}", "date": date, "device": "NVIDIA H200", "versions": {},
            "ceilings": {"copy_GBps": copy, "bf16_TFLOPs": 700.0, "fp8_TFLOPs": 1280.0}, "notes": "",
            "rows": [{"kernel": k, "case": c, "goal": None, "ms": ms, "fraction_of_ceiling": 0.5, "peers": {}}
                     for k, c, ms in rows]}  # fmt: skip


def test_newest_row_per_case_and_every_run_kept(tmp_path: Path) -> None:
    old = _record(
        "2026-11-29", 4218.0, [("w4a16", "M=1 N=8192 K=8192", 0.0244), ("mla-decode", "kv=fp8", 9.4)]
    )
    new = _record("2026-12-01", 4222.0, [("w4a16", "M=1 N=8192 K=8192", 0.0121)])
    merged = merge([old, new])
    assert [r["date"] for r in merged["runs"]] == ["2026-11-29", "2026-12-01"]
    assert merged["ceilings"]["copy_GBps"] == 4218.0 and merged["date"] == "2026-12-01"
    by_case = {(r["kernel"], r["case"]): r for r in merged["rows"]}
    assert by_case[("w4a16", "M=1 N=8192 K=8192")]["ms"] == 0.0121
    assert (
        by_case[("w4a16", "M=1 N=8192 K=8192")]["run"] == 1 and by_case[("mla-decode", "kv=fp8")]["run"] == 0
    )
    paths = []
    for i, record in enumerate((old, new)):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(record))
    assert main([str(tmp_path / "out.json"), *map(str, paths)]) == 0
    assert json.loads((tmp_path / "out.json").read_text())["rows"] == merged["rows"]


def test_a_merged_file_takes_new_records_and_keeps_its_runs(tmp_path: Path) -> None:
    old = _record(
        "2026-11-29", 4218.0, [("w4a16", "M=1 N=8192 K=8192", 0.0244), ("mla-decode", "kv=fp8", 9.4)]
    )
    mid = _record("2026-12-01", 4222.0, [("tag-check", "dsa-indexer kv=fp8", 0.19)])
    merged = merge([old, mid])
    new = _record("2026-12-03", 4220.0, [("tag-check", "dsa-indexer kv=fp8", 0.17)])
    again = merge([merged, new])
    assert [r["date"] for r in again["runs"]] == ["2026-11-29", "2026-12-01", "2026-12-03"]
    by_case = {(r["kernel"], r["case"]): r for r in again["rows"]}
    assert by_case[("tag-check", "dsa-indexer kv=fp8")]["ms"] == 0.17
    assert by_case[("tag-check", "dsa-indexer kv=fp8")]["run"] == 2
    assert by_case[("mla-decode", "kv=fp8")]["run"] == 0 and again["ceilings"]["copy_GBps"] == 4218.0
    assert again == merge([old, mid, new])  # the same as merging the sources
    out = tmp_path / "kernels.json"
    out.write_text(json.dumps(merged))
    (tmp_path / "new.json").write_text(json.dumps(new))
    assert main([str(out), str(out), str(tmp_path / "new.json")]) == 0  # in place
    assert json.loads(out.read_text()) == again

"""`kumo bench engine` end to end at --tiny scale on the CPU: records, summary, Markdown, merge."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backend.tools.plan import make_plan
from benchmarks.cli import main as bench_main
from benchmarks.engine.geometry import FULL_TP, TINY_GPU_MEM, make_geometry

SUMMARY_KEYS = {
    "fp8kv_vs_bf16kv_long_c64", "fp8kv_vs_bf16kv_c1", "int4_vs_fp8_decode_c1", "int4_vs_fp8_prefill",
    "integrity_overhead", "vs_transformers_c64", "capacity_fp8_over_bf16",
}  # fmt: skip
TINY = [
    "--tiny",
    "--layers",
    "2",
    "--input-len",
    "8",
    "--output-len",
    "3",
    "--prefill-len",
    "32",
    "--max-concurrency-cap",
    "0",
]
COMMANDS = {
    "weights": ["weights", "--concurrency", "1,2", "--profile-concurrency", "2", "--chunk", "9"],
    "weights-all": ["weights", "--all-linear", "--concurrency", "1"],
    "kv": ["kv", "--concurrency", "1,64"],
    "integrity": ["integrity", "--repeats", "2", "--integrity-concurrency", "2"],
    "transformers": [
        "transformers",
        "--kumo",
        "int4:fp8",
        "--concurrency",
        "1,64",
        "--hf-modes",
        "generate,generate_batch",
    ],
}


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    out = tmp_path_factory.mktemp("bench")
    found = {}
    for name, args in COMMANDS.items():
        path = out / f"{name}.json"
        assert bench_main(["engine", *args, *TINY, "--out", str(path)]) == 0
        found[name] = (path, json.loads(path.read_text()))
    return found


def test_every_record_has_the_schema(records: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    for name, (path, rec) in records.items():
        assert {"command", "date", "device", "geometry", "runs", "summary"} <= set(rec), name
        assert set(rec["summary"]) == SUMMARY_KEYS
        assert rec["command"].startswith("kumo bench engine " + name.removesuffix("-all"))
        assert rec["device"].startswith("cpu") and rec["geometry"]["is_tiny"]
        assert rec["runs"], name
        assert path.with_suffix(".md").read_text().startswith("# Engine benchmark")


def test_a_sweep_measures_no_summary_ratio(records: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    """One sample a point, variants one after the other: the summary's ratios come only from the
    scenarios (`kumo bench engine scenario KEY`); a sweep's are null, and say where to get them."""
    for name, (_, rec) in records.items():
        assert all(v is None for v in rec["summary"].values()), name
        assert rec["summary_detail"]["integrity_overhead"].endswith("scenario integrity_overhead`")
    # --all-linear: every Linear quantized in both
    all_linear = records["weights-all"][1]
    assert [v["weights"] for v in all_linear["variants"]] == ["int4-all", "fp8-all"]
    assert all_linear["variants"][1]["weight_bytes"] < records["weights"][1]["variants"][1]["weight_bytes"]
    # every level's untimed pass ran the timed run's step shapes
    for name in ("weights", "kv"):
        for v in records[name][1]["variants"]:
            assert v["warmup_missed_shapes"] == [], (name, v["variant"])
    # the engine's own switch: on the CPU the reference ops skip the check too, so it is measured
    integrity = records["integrity"][1]["integrity"]
    assert integrity["switched"].startswith("EngineConfig.check_page_tags")
    assert integrity["on"]["n"] == integrity["off"]["n"] == 2 and integrity["rounds_skipped"] == 0
    on, off = integrity["samples"]["on"], integrity["samples"]["off"]
    assert [r["variant"].rsplit("/", 1)[1] for r in on + off] == ["tags-on"] * 2 + ["tags-off"] * 2
    per_round = [a["tpot_ms_p50"] / b["tpot_ms_p50"] - 1 for a, b in zip(on, off, strict=True)]
    assert integrity["overhead_per_round"] == pytest.approx(per_round)
    assert integrity["overhead"] == pytest.approx(sum(per_round) / 2)
    md = records["integrity"][0].with_suffix(".md").read_text()
    assert "Integrity A/B at concurrency 2, 2+2 interleaved runs" in md


def test_numbers_are_measured(records: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    runs = [r for _, rec in records.values() for r in rec["runs"] if r["source"] == "kumo"]
    for r in runs:
        assert r["output_tokens"] == r["concurrency"] * r["output_len"]
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["wall_s"])
        assert r["ttft_ms_p50"] > 0 and r["tpot_ms_p50"] > 0
    assert len({r["wall_s"] for r in runs}) == len(runs)  # timings, not constants
    hf = records["transformers"][1]["transformers"]["modes"]
    assert hf["generate"]["runs"] and hf["generate"]["runs"][0]["output_tok_s"] > 0
    assert "generate_batch" in hf  # tried: its result or its error is recorded
    assert hf["generate_batch"]["runs"] or hf["generate_batch"]["error"]


def test_kv_pool_follows_kumo_plan(records: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    rec = records["kv"][1]
    g = make_geometry(rec["geometry"]["kind"], 2, tiny=True)
    for v in rec["variants"]:
        plan = make_plan(g.full, gpu_mem=TINY_GPU_MEM, tp=FULL_TP, weights="int4-g32", kv_dtype=v["kv_dtype"])
        assert v["kv_sizing"]["kv_tokens"] == plan.kv_tokens
        assert v["kv_capacity_tokens"] == plan.kv_tokens // 16 * 16
        assert v["max_concurrency"] == plan.kv_tokens // 16 // 1  # 11-token requests: one page each
    bf16, fp8 = sorted(rec["variants"], key=lambda v: v["kv_dtype"])
    assert fp8["kv_capacity_tokens"] > 1.9 * bf16["kv_capacity_tokens"]


def test_report_merges_the_calls(records: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path) -> None:
    out = tmp_path / "merged.json"
    assert bench_main(["engine", "report", *[str(p) for p, _ in records.values()], "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert set(merged["summary"]) == SUMMARY_KEYS and all(v is None for v in merged["summary"].values())
    assert merged["integrity"] == records["integrity"][1]["integrity"]
    assert merged["transformers"] == records["transformers"][1]["transformers"]
    assert len(merged["runs"]) == sum(len(rec["runs"]) for _, rec in records.values())
    assert "PROJECTION" in out.with_suffix(".md").read_text()


def test_the_step_profile_names_where_a_step_goes(records: dict[str, tuple[Path, dict[str, Any]]]) -> None:
    path, rec = records["weights"]
    for v in rec["variants"]:
        profile = v["step_profile"]
        assert profile["concurrency"] == 2
        steps = profile["steps"]
        assert set(steps) == {"prefill", "mixed", "decode"}
        assert steps["prefill"]["decode_rows"] == 0 and steps["decode"]["decode_rows"] == 2
        assert steps["mixed"]["decode_rows"] == 1  # --chunk 9: one decode row beside the 8-token prompt
        for step in steps.values():
            assert step["wall_ms"] > 0 and step["ranked_by"] == "own CPU time"
            assert step["ops"] and all(o["count"] >= 1 for o in step["ops"])
            cpu = [o["cpu_ms"] for o in step["ops"]]
            assert cpu == sorted(cpu, reverse=True)
    assert "Step profile, mixed: step" in path.with_suffix(".md").read_text()
    # the timed runs' own record of the steps that carried prompt tokens
    run = next(r for r in rec["runs"] if r["concurrency"] == 2)
    assert run["extra"]["prefill_steps"] >= 2 and run["extra"]["prefill_step_tokens_p50"] > 0


def test_a_merge_of_different_depths_names_each_rows_depth(
    records: dict[str, tuple[Path, dict[str, Any]]], tmp_path: Path
) -> None:
    deeper = json.loads(records["kv"][0].read_text())
    deeper["geometry"] = dict(deeper["geometry"], num_layers=3)  # as the transformers peer ran at 3 of 4
    path = tmp_path / "deeper.json"
    path.write_text(json.dumps(deeper))
    out = tmp_path / "merged.json"
    assert bench_main(["engine", "report", str(records["weights"][0]), str(path), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert {r["layers"] for r in merged["runs"]} == {2, 3}
    md = out.with_suffix(".md").read_text()
    assert " 2 of " in md and " 3 of " in md
    assert "(3 layers) int4-weights/fp8-kv" in md and "(2 layers) int4-weights/bf16-kv" in md


def test_entry_point_imports_neither_torch_nor_msgspec() -> None:
    code = "import sys, benchmarks.cli, benchmarks.engine.cli; print('msgspec' in sys.modules, 'torch' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        cwd=Path(__file__).parents[2],
    )
    assert done.stdout.split() == ["False", "False"]


def test_runs_past_the_budget_are_recorded_as_skipped_not_estimated(tmp_path: Path) -> None:
    out = tmp_path / "late.json"
    assert (
        bench_main(["engine", "variant", *TINY, "--concurrency", "1,2", "--budget-s", "0", "--out", str(out)])
        == 0
    )
    rec = json.loads(out.read_text())
    (variant,) = rec["variants"]
    assert [s["concurrency"] for s in variant["skipped"]] == [1, 2]
    assert not [r for r in rec["runs"] if r["source"] == "kumo"]
    assert all(v is None for v in rec["summary"].values())
    json.loads(out.read_text(), parse_constant=lambda c: pytest.fail(f"{c} in the record"))  # strict JSON

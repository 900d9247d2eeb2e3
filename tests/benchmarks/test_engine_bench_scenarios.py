"""`kumo bench engine scenario NAME` end to end at --tiny scale on the CPU: every scenario's record
carries its A/B/B/A rounds, their summary entry, a warm-up that ran every timed step shape, and the
fresh-machine flag; records of one scenario from several calls pool their rounds."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import main as bench_main
from benchmarks.engine.report import TARGETS
from benchmarks.engine.scenarios import SCENARIOS

# the long-context and capacity scenarios' pools: BF16 KV 96 tokens, 3 requests of 24 + 6; FP8 twice that
POOL = ["--pool-scale", "0.002"]


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("triton")


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory, cache: Path) -> dict[str, dict[str, Any]]:
    out = tmp_path_factory.mktemp("scenarios")
    found = {}
    for name in SCENARIOS:  # in the table's order: the first is the fresh machine's first process
        path = out / f"{name}.json"
        pool = POOL if name in ("fp8kv_vs_bf16kv_long_c64", "capacity_fp8_over_bf16") else []
        args = [
            "engine",
            "scenario",
            name,
            "--tiny",
            *pool,
            "--compile-cache",
            str(cache),
            "--out",
            str(path),
        ]
        assert bench_main(args) == 0
        found[name] = json.loads(path.read_text())
    return found


def test_the_scenarios_are_the_summary_keys() -> None:
    assert set(SCENARIOS) == set(TARGETS)
    assert "fp8kv_vs_bf16kv_c64" not in TARGETS  # retired: it divided c=64 by BF16's peak at c=256


def test_each_scenario_runs_three_a_b_b_a_rounds_into_its_summary_entry(
    records: dict[str, dict[str, Any]],
) -> None:
    for name, rec in records.items():
        entry = rec["scenarios"][name]
        num_rounds = SCENARIOS[name].num_rounds
        assert num_rounds >= 3 or name == "capacity_fp8_over_bf16", name  # a count, not a timing
        assert entry["order"] == ["A", "B", "B", "A"] * num_rounds
        assert [[run["side"] for run in r["runs"]] for r in entry["rounds"]] == [
            ["A", "B", "B", "A"]
        ] * num_rounds
        assert entry["rounds_skipped"] == entry["rounds_incomplete"] == 0
        ratios = [r["ratio"] - (name == "integrity_overhead") for r in entry["rounds"]]
        summary = rec["summary"][name]
        assert set(summary) == {"value", "samples", "spread"}, name
        assert summary["samples"] == pytest.approx(ratios)
        assert summary["value"] == pytest.approx(statistics.median(ratios))
        assert summary["spread"] == pytest.approx([min(ratios), max(ratios)])
        assert [k for k, v in rec["summary"].items() if v is not None] == [name]  # nothing else guessed
        labels = [run["variant"].split("/")[1] for r in entry["rounds"] for run in r["runs"]]
        a, b = entry["sides"]["A"]["label"], entry["sides"]["B"]["label"]
        assert labels == [a, b, b, a] * num_rounds


def test_the_warm_up_ran_every_step_shape_of_the_timed_runs(records: dict[str, dict[str, Any]]) -> None:
    for name, rec in records.items():
        entry = rec["scenarios"][name]
        assert entry["warm_up_missed_shapes"] == {"A": [], "B": []}, name
        for key, warm in entry["warm_up"].items():
            assert warm["s"] > 0
            # the engine's runs record their shapes (the peer's do not; a fill is a count, not timed)
            if not entry["sides"][key]["is_transformers"] and name != "capacity_fp8_over_bf16":
                assert warm["num_step_shapes"] > 0, (name, key)


def test_a_run_without_warm_up_is_caught_cold(tmp_path: Path, cache: Path) -> None:
    path = tmp_path / "cold.json"
    args = ["engine", "scenario", "fp8kv_vs_bf16kv_c1", "--tiny", "--no-warm-up", "--rounds", "1"]
    assert bench_main([*args, "--compile-cache", str(cache), "--out", str(path)]) == 0
    entry = json.loads(path.read_text())["scenarios"]["fp8kv_vs_bf16kv_c1"]
    assert entry["warm_up"] is None
    assert entry["warm_up_missed_shapes"]["A"] and entry["warm_up_missed_shapes"]["B"]
    assert "timed step shapes it missed" in path.with_suffix(".md").read_text()


def test_a_shorter_warm_up_probes_the_planned_shapes_it_missed(tmp_path: Path) -> None:
    """The long workload warmed on 2 output tokens (the device run's 1,024 of 4,096): the shorter pass
    misses decode widths and recompute chunks, the probes run them, and the check stays true."""
    path = tmp_path / "long.json"
    args = ["engine", "scenario", "fp8kv_vs_bf16kv_long_c64", "--tiny", *POOL, "--warm-up-lengths", "24", "2"]
    assert (
        bench_main([*args, "--rounds", "1", "--compile-cache", str(tmp_path / "c"), "--out", str(path)]) == 0
    )
    entry = json.loads(path.read_text())["scenarios"]["fp8kv_vs_bf16kv_long_c64"]
    assert entry["warm_up_missed_shapes"] == {"A": [], "B": []}
    for warm in entry["warm_up"].values():
        assert warm["lengths"] == [24, 2] and warm["probed_shapes"] and warm["plan_matched_timed"]
    assert len(entry["rounds"]) == 1 and entry["rounds_incomplete"] == 0
    assert "timed shapes the scheduler planned" in path.with_suffix(".md").read_text()


def test_only_the_first_process_on_the_compile_cache_is_fresh(records: dict[str, dict[str, Any]]) -> None:
    fresh = [rec["machine"]["is_fresh"] for rec in records.values()]
    assert fresh == [True] + [False] * (len(fresh) - 1)


def test_each_scenario_records_what_it_is_judged_by(records: dict[str, dict[str, Any]]) -> None:
    long = records["fp8kv_vs_bf16kv_long_c64"]["scenarios"]["fp8kv_vs_bf16kv_long_c64"]
    assert long["workload"]["concurrency"] == 4
    fp8, bf16 = long["sides"]["A"], long["sides"]["B"]
    assert bf16["requests_that_fit"] < 4 <= fp8["requests_that_fit"]  # BF16 queues what does not fit
    assert long["beside"]["steady_decode_tok_s_ratio"]["samples"]
    decode = records["int4_vs_fp8_decode_c1"]["scenarios"]["int4_vs_fp8_decode_c1"]
    assert (decode["sides"]["A"]["weights"], decode["sides"]["B"]["weights"]) == ("int4-all", "fp8-all")
    assert decode["beside"]["bytes_ceiling"] > 1.0 and decode["beside"]["bytes_ceiling_full_depth"] > 1.0
    prefill = records["int4_vs_fp8_prefill"]["scenarios"]["int4_vs_fp8_prefill"]
    run = prefill["rounds"][0]["runs"][0]
    assert run["output_len"] == 1 and run["prefill_tok_s"] == pytest.approx(64 / (run["ttft_ms_max"] / 1e3))
    integrity = records["integrity_overhead"]["scenarios"]["integrity_overhead"]
    assert [integrity["sides"][k]["check_page_tags"] for k in "AB"] == [True, False]
    peer = records["vs_transformers_c64"]["scenarios"]["vs_transformers_c64"]
    assert peer["sides"]["B"]["is_transformers"] and peer["rounds"][0]["runs"][1]["mode"] == "generate"
    assert records["vs_transformers_c64"]["geometry"]["num_layers"] == 2  # --tiny; 3 by default
    capacity = records["capacity_fp8_over_bf16"]["scenarios"]["capacity_fp8_over_bf16"]
    for run in capacity["rounds"][0]["runs"]:  # filled until the pool preempted: most of it was in use
        assert run["is_complete"] and 0.75 * run["pool_tokens"] <= run["kv_tokens_held"] <= run["pool_tokens"]
    assert 1.8 < records["capacity_fp8_over_bf16"]["summary"]["capacity_fp8_over_bf16"]["value"] < 2.2


def test_a_merge_pools_the_rounds_of_one_scenario_split_over_calls(
    records: dict[str, dict[str, Any]], tmp_path: Path, cache: Path
) -> None:
    name = "fp8kv_vs_bf16kv_c1"
    second = tmp_path / "second.json"
    args = ["engine", "scenario", name, "--tiny", "--rounds", "2", "--compile-cache", str(cache)]
    assert bench_main([*args, "--out", str(second)]) == 0
    first = tmp_path / "first.json"
    first.write_text(json.dumps(records[name]))
    other = tmp_path / "other.json"
    other.write_text(json.dumps(records["integrity_overhead"]))
    out = tmp_path / "merged.json"
    assert bench_main(["engine", "report", str(first), str(second), str(other), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    samples = (
        records[name]["summary"][name]["samples"] + json.loads(second.read_text())["summary"][name]["samples"]
    )
    assert merged["summary"][name]["samples"] == pytest.approx(samples)
    assert merged["summary"][name]["value"] == pytest.approx(statistics.median(samples))
    assert merged["scenarios"][name]["order"] == ["A", "B", "B", "A"] * 5
    assert (
        merged["summary"]["integrity_overhead"]
        == records["integrity_overhead"]["summary"]["integrity_overhead"]
    )
    assert [m["is_fresh"] for m in merged["machines"]] == [False, False, False]
    md = out.with_suffix(".md").read_text()
    assert f"| {name} | " in md and "| 5 |" in md

"""`kumo bench engine decode-c1` end to end at --tiny scale on the CPU: per format A/B/B/A rounds of
the decode step against the copy of the bytes a token reads, the summary the worst format's entry,
and the bytes themselves against a count from the geometry's own numbers."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import main as bench_main
from benchmarks.engine.decode_c1 import FORMATS, SUMMARY_KEY
from benchmarks.engine.geometry import make_geometry


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("decode_c1") / "rec.json"
    cache = tmp_path_factory.mktemp("triton")
    assert (
        bench_main(["engine", "decode-c1", "--tiny", "--compile-cache", str(cache), "--out", str(out)]) == 0
    )
    assert out.with_suffix(".md").read_text().count("\n| ") == len(FORMATS) + 1  # header + a row each
    return json.loads(out.read_text())


def test_every_format_runs_a_b_b_a_rounds_of_step_over_bytes(record: dict[str, Any]) -> None:
    assert tuple(record["formats"]) == FORMATS
    for fmt, e in record["formats"].items():
        assert e["order"] == ["A", "B", "B", "A"] * 3
        assert e["rounds_incomplete"] == e["rounds_skipped"] == 0
        assert e["warm_up_missed_shapes"] == []  # the warm-up ran every timed step shape
        for r in e["rounds"]:
            a = [run["step_ms"] for run in r["runs"] if run["side"] == "A"]
            b = [run["bytes_ms"] for run in r["runs"] if run["side"] == "B"]
            assert r["ratio"] == pytest.approx(sum(a) / sum(b))
            for run in r["runs"]:
                if run["side"] == "B":  # the bytes over the bandwidth measured in this run
                    assert run["bytes_ms"] == pytest.approx(e["bytes_read"] / (run["copy_GBps"] * 1e9) * 1e3)
                else:
                    assert run["step_ms"] == run["extra"]["decode_step_ms_p50"] > 0
        ratios = [r["ratio"] for r in e["rounds"]]
        assert e["summary"] == {
            "value": pytest.approx(statistics.median(ratios)),
            "samples": pytest.approx(ratios),
            "spread": pytest.approx([min(ratios), max(ratios)]),
        }, fmt


def test_the_summary_is_the_worst_format(record: dict[str, Any]) -> None:
    by_format = {f: e["summary"]["value"] for f, e in record["formats"].items()}
    worst = max(by_format, key=by_format.__getitem__)
    assert record["worst_format"] == worst
    assert record["summary"] == {SUMMARY_KEY: record["formats"][worst]["summary"]}
    quantized = {f: v for f, v in by_format.items() if f != "bf16"}
    worst_quantized = max(quantized, key=quantized.__getitem__)
    assert record["worst_quantized_format"] == worst_quantized
    assert record["worst_quantized"] == record["formats"][worst_quantized]["summary"]


def test_records_of_several_calls_merge(record: dict[str, Any], tmp_path: Path) -> None:
    """Formats split over calls: the merge holds every format and the worst of them all."""
    first = dict(record, formats={f: e for f, e in record["formats"].items() if f != record["worst_format"]})
    second = dict(record, formats={record["worst_format"]: record["formats"][record["worst_format"]]})
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, r in zip(paths, (first, second), strict=True):
        path.write_text(json.dumps(r))
    out = tmp_path / "merged.json"
    assert bench_main(["engine", "decode-c1", "--merge", *map(str, paths), "--out", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert set(merged["formats"]) == set(FORMATS)
    assert merged["summary"] == record["summary"] and merged["worst_format"] == record["worst_format"]
    assert len(merged["sources"]) == 2


def test_bytes_a_token_reads_from_the_geometry(record: dict[str, Any]) -> None:
    """BF16: the routed experts a token touches are top_k of them; lm_head whole; one embedding row;
    KV = each layer's latent (R + Dr) and indexer key (Di) in bf16, at the mean decode context."""
    t = make_geometry("glm-5.2", 2, tiny=True).text
    H, I, k = t["hidden_size"], t["moe_intermediate_size"], t["num_experts_per_tok"]
    e = record["formats"]["bf16"]
    parts = e["token_weight_bytes"]
    assert parts["routed_experts_touched"] == 1 * k * 3 * H * I * 2  # one MoE layer of the two
    assert parts["lm_head"] == t["vocab_size"] * H * 2
    assert parts["embedding_row"] == H * 2
    assert parts["shared_experts"] == 3 * H * I * t["n_shared_experts"] * 2
    assert parts["dense_mlp"] == 3 * H * t["intermediate_size"] * 2
    per_token = 2 * (t["kv_lora_rank"] + t["qk_rope_head_dim"] + t["index_head_dim"]) * 2
    assert e["kv_bytes_per_token"] == per_token
    assert e["context_tokens"] == 24 + 6 / 2
    assert e["bytes_read"] == pytest.approx(sum(parts.values()) + per_token * e["context_tokens"])
    # INT4 routed experts: 4 bits and a bf16 scale per 32 weights
    int4 = record["formats"]["int4"]["token_weight_bytes"]["routed_experts_touched"]
    assert int4 == k * 3 * H * I * (4 + 16 / 32) // 8

"""`kumo bench engine decode-c1` end to end at --tiny scale on the CPU: per format A/B/B/A rounds of
the decode step against the copy of the bytes a token reads, the summary the worst format's entry,
and the bytes themselves against a count from the geometry's own numbers; `--rank-of 2` (a
subprocess: joining the local process group is for the life of a process) on rank 0's share of them,
under its own summary key, with the collectives' modelled time beside."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import main as bench_main
from benchmarks.engine.decode_c1 import FORMATS, SUMMARY_KEY, depths, markdown, no_room, parser, summarize
from benchmarks.engine.geometry import make_geometry

ROOT = Path(__file__).resolve().parents[2]
N = 2  # the tiny model's 4 heads split 2 ways (not 8)


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


# ---- --rank-of N --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def rank_of(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("decode_c1_rank_of") / "rec.json"
    cache = tmp_path_factory.mktemp("triton")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks.cli", "engine", "decode-c1", "--tiny", "--rank-of", str(N)]
    done = subprocess.run(
        [*cmd, "--compile-cache", str(cache), "--out", str(out)], env=env, cwd=ROOT, timeout=300,
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_rank_of_writes_its_own_key_beside_the_modelled_collectives(rank_of: dict[str, Any]) -> None:
    key = f"{SUMMARY_KEY}_rank_of_{N}"
    worst = rank_of["worst_format"]
    assert rank_of["summary"] == {key: rank_of["formats"][worst]["summary"]}  # never the 10-layer key
    assert rank_of["goal"] == "<= 2.5x at rank-of-8"
    assert rank_of["parallel"] == {
        "rank_of": N, "tp": N, "ep": N, "dcp": 1, "layout": f"rank 0 of {N}, alone (collectives local)"
    }  # fmt: skip
    assert (rank_of["geometry"]["layers"], rank_of["geometry"]["full_num_layers"]) == (2, 78)
    for fmt, e in rank_of["formats"].items():
        assert e["geometry"]["rank_of"] == N and e["rounds_incomplete"] == e["rounds_skipped"] == 0, fmt
        c = e["collectives"]
        assert c["label"].startswith("modelled") and c["world_size"] == N
        assert c["modelled_ms"] == pytest.approx(c["per_decode_step"]["c1"]["total"]["modelled_s"] * 1e3)
        assert c["modelled_ms"] > 0
        for r in e["rounds"]:  # each A step plus the modelled time, over the same copies
            a = [run["step_ms"] + c["modelled_ms"] for run in r["runs"] if run["side"] == "A"]
            b = [run["bytes_ms"] for run in r["runs"] if run["side"] == "B"]
            assert r["ratio_with_modelled_nvlink"] == pytest.approx(sum(a) / sum(b))
            assert r["ratio_with_modelled_nvlink"] > r["ratio"]
        assert e["summary_with_modelled_nvlink"]["value"] > e["summary"]["value"]
    nvlink = rank_of["with_modelled_nvlink"]
    assert nvlink["label"].startswith("modelled")
    by_format = {f: e["summary_with_modelled_nvlink"] for f, e in rank_of["formats"].items()}
    assert nvlink[f"{key}_with_modelled_nvlink"] == by_format[nvlink["worst_format"]]
    assert max(v["value"] for v in by_format.values()) == by_format[nvlink["worst_format"]]["value"]


def test_rank_of_reads_rank_0s_share_of_the_bytes(record: dict[str, Any], rank_of: dict[str, Any]) -> None:
    """Heads, dense and shared MLPs split N ways; E/N whole experts on rank 0, which reads the token's
    k experts that fall there (k·(E/N)/E expected); ⌈V/N⌉ rows of lm_head; routers, norms, the
    embedding row and the KV (latent and indexer keys) replicated. BF16 exactly; every format's
    total to within what the quantized attention's split share moves."""
    t = make_geometry("glm-5.2", 2, tiny=True, rank_of=N).text
    E, k, V, H = t["n_routed_experts"], t["num_experts_per_tok"], t["vocab_size"], t["hidden_size"]
    heads, R, Dn, Dr, Dv = (
        t["num_attention_heads"], t["kv_lora_rank"], t["qk_nope_head_dim"], t["qk_rope_head_dim"], t["v_head_dim"],
    )  # fmt: skip
    local = E // N
    # q_b_proj, kv_b_proj (dense after load), o_proj: the head-split Linears, bf16, 2 layers
    split = 2 * 2 * (t["q_lora_rank"] * heads * (Dn + Dr) + R * heads * (Dn + Dv) + heads * Dv * H)
    share = {"routed_experts_touched": local / E, "lm_head": math.ceil(V / N) / V, "dense_mlp": 1 / N,
             "shared_experts": 1 / N, "router": 1, "norms": 1, "embedding_row": 1}  # fmt: skip
    one, bf16 = (
        record["formats"]["bf16"]["token_weight_bytes"],
        rank_of["formats"]["bf16"]["token_weight_bytes"],
    )
    assert bf16 == {p: one[p] * share[p] for p in share} | {
        "attention": one["attention"] - split * (1 - 1 / N)
    }
    attention_share = bf16["attention"] / one["attention"]
    for fmt, e in rank_of["formats"].items():
        full = record["formats"][fmt]
        parts = full["token_weight_bytes"]
        assert e["kv_bytes_per_token"] == full["kv_bytes_per_token"]  # replicated: no DCP
        assert e["collectives"]["routed_local_share_assumed"] == local / E
        assert e["routed_experts_per_moe_layer"] == k * local / E
        assert 0 <= e["collectives"]["routed_local_share_in_probe"] <= 1
        expected = sum(parts[p] * share[p] for p in share) + parts["attention"] * attention_share
        assert e["bytes_read"] < full["bytes_read"]
        assert e["bytes_read"] == pytest.approx(expected + e["kv_bytes"], rel=0.08), fmt


def test_rank_of_depths_and_what_does_not_fit_one_h200() -> None:
    """--rank-of: the full depth by default and BF16 with it, which no H200 holds (190 GB at rank 0
    of 8, `kumo plan`): skipped, said so; INT4 and FP8 every Linear fit (54, 96 GB)."""
    assert depths(parser().parse_args([])) == (10, 6, 78)
    assert depths(parser().parse_args(["--rank-of", "8"])) == (78, 78, 78)
    assert depths(parser().parse_args(["--rank-of", "8", "--layers", "10"])) == (10, 10, 78)
    assert depths(parser().parse_args(["--rank-of", "2", "--tiny"]))[:2] == (2, 2)
    full = make_geometry("glm-5.2", None, rank_of=8)
    assert "skipped" in (no_room(full, "bf16", "fp8-block") or "")
    assert no_room(full, "int4-all", "fp8-block") is no_room(full, "fp8-all", "fp8-block") is None
    assert no_room(make_geometry("glm-5.2", 6, rank_of=8), "bf16", "fp8-block") is None


def test_a_skipped_format_is_a_row_and_no_sample(rank_of: dict[str, Any]) -> None:
    formats = dict(rank_of["formats"], bf16={"weights": "bf16", "layers": 78, "skipped": "skipped: no room",
                                              "rounds": [], "summary": None})  # fmt: skip
    summary = summarize(formats, N)
    assert "bf16" not in summary["summary_detail"][f"{SUMMARY_KEY}_rank_of_{N}"]
    assert "| bf16 | 78 | skipped: no room |" in markdown(rank_of | summary)


def test_pdl_ab_runs_rounds_of_the_step_with_pdl_on_against_off(tmp_path: Path) -> None:
    """`--pdl-ab`: after the format's rounds, A/B/B/A rounds of PDL on (A) against a second engine with
    it off (B), the ratio on / off per round and their summary; the switch and whether launches used
    it (never on the CPU) recorded; and it refuses `--no-pdl`."""
    out = tmp_path / "rec.json"
    argv = [
        "engine",
        "decode-c1",
        "--tiny",
        "--formats",
        "int4",
        "--rounds",
        "2",
        "--compile-cache",
        str(tmp_path),
    ]
    assert bench_main([*argv, "--pdl-ab", "--out", str(out)]) == 0
    record = json.loads(out.read_text())
    assert record["options"]["pdl"] and record["options"]["pdl_ab"] and record["pdl_active"] is False
    entry = record["formats"]["int4"]
    ab = entry["pdl_ab"]
    assert ab["order"] == ["A", "B", "B", "A"] * 2 and ab["rounds_incomplete"] == ab["rounds_skipped"] == 0
    for r in ab["rounds"]:
        a = [run["step_ms"] for run in r["runs"] if run["side"] == "A"]
        b = [run["step_ms"] for run in r["runs"] if run["side"] == "B"]
        assert r["ratio"] == pytest.approx(sum(a) / sum(b)) and min(a + b) > 0
    assert ab["step_ratio"]["samples"] == pytest.approx([r["ratio"] for r in ab["rounds"]])
    assert entry["summary"] is not None and len(entry["rounds"]) == 2  # the step-over-bytes rounds too
    assert "PDL on / off (int4, `--pdl-ab`)" in out.with_suffix(".md").read_text()
    with pytest.raises(SystemExit, match="--no-pdl"):
        bench_main([*argv, "--pdl-ab", "--no-pdl", "--out", str(out)])

"""`kumo bench serve` against the embedded `kumo serve` (tiny settings), and its SLO arithmetic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import main as bench_main
from benchmarks.serve import RequestResult, meets_slo, summarize, text_of

KIMI = "@cf/moonshotai/kimi-k2.6"


def bench(kumo: Any, out: Path, *extra: str) -> dict[str, Any]:
    argv = ["serve", "--url", kumo.url, "--account", kumo.account, "--token", kumo.token, "--model", KIMI,
            "--concurrency", "2", "--input-len", "96", "--output-len", "4", "--out", str(out), *extra]  # fmt: skip
    assert bench_main(argv) == 0
    assert kumo.token not in out.read_text()  # the command is recorded with the token masked
    return dict(json.loads(out.read_text()))


def test_figures_are_consistent_with_each_request(kumo: Any, tmp_path: Path) -> None:
    # greedy: a sampled answer may stream no text at all (markup the server withholds, cut by
    # max_tokens: CI once drew one), and then has no first token to time
    rec = bench(
        kumo, tmp_path / "serve.json", "--requests", "5", "--slo-ttft-ms", "1e9", "--slo-tpot-ms", "1e9",
        "--extra", '{"temperature": 0}',
    )  # fmt: skip
    assert {"command", "date", "machine", "config", "summary", "requests"} <= set(rec)
    reqs, s = rec["requests"], rec["summary"]
    assert [r["index"] for r in reqs] == list(range(5)) and s["num_ok"] == 5 and s["num_errors"] == 0
    for r in reqs:
        assert 0 < r["ttft_ms"] <= r["e2e_ms"]
        assert 1 <= r["num_chunks"] <= r["output_tokens"] <= 4  # max_tokens holds; a chunk has >= 1 token
        assert len(r["itl_ms"]) == r["num_chunks"] - 1
        if r["output_tokens"] > 1:
            assert r["tpot_ms"] == pytest.approx((r["e2e_ms"] - r["ttft_ms"]) / (r["output_tokens"] - 1))
    for c in (0, 1):  # each client sends its next request only after the last one ended
        mine = sorted((r for r in reqs if r["client"] == c), key=lambda r: r["start_s"])
        for a, b in zip(mine, mine[1:], strict=False):
            assert b["start_s"] >= a["start_s"] + a["e2e_ms"] / 1e3
    wall = s["wall_s"]
    assert max(r["start_s"] + r["e2e_ms"] / 1e3 for r in reqs) <= wall
    assert s["requests_per_s"] == pytest.approx(5 / wall)
    assert s["output_tok_s"] == pytest.approx(sum(r["output_tokens"] for r in reqs) / wall)
    assert s["goodput_requests_per_s"] == pytest.approx(s["requests_per_s"])  # SLOs nobody misses
    assert abs(s["prompt_tokens"]["mean"] - 96) <= 0.15 * 96  # calibrated against usage.prompt_tokens
    assert rec["markdown"].startswith(f"| {KIMI} | 2 |")


def test_duration_mode_sends_until_the_deadline(kumo: Any, tmp_path: Path) -> None:
    rec = bench(kumo, tmp_path / "serve.json", "--duration", "1.5", "--slo-ttft-ms", "0.001")
    reqs, s = rec["requests"], rec["summary"]
    assert len(reqs) >= 2 and all(r["start_s"] < 1.5 for r in reqs)
    assert s["num_meeting_slo"] == 0 and s["goodput_requests_per_s"] == 0.0 < s["requests_per_s"]


def test_repeats_measure_windows_apart_each_a_sample_of_the_median_and_spread(
    kumo: Any, tmp_path: Path
) -> None:
    rec = bench(kumo, tmp_path / "serve.json", "--requests", "3", "--repeats", "3", "--slo-ttft-ms", "1e9")
    assert len(rec["repeats"]) == 3 and [s["num_ok"] for s in rec["repeats"]] == [3, 3, 3]
    reqs = rec["requests"]
    assert [r["repeat"] for r in reqs] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
    for k, s in enumerate(rec["repeats"]):  # each repeat's figures are its own requests'
        mine = [r for r in reqs if r["repeat"] == k]
        assert s["output_tok_s"] == pytest.approx(sum(r["output_tokens"] for r in mine) / s["wall_s"])
    tok_s = [s["output_tok_s"] for s in rec["repeats"]]
    entry = rec["per_repeat"]["output_tok_s"]
    assert entry["samples"] == pytest.approx(tok_s) and entry["value"] == pytest.approx(sorted(tok_s)[1])
    assert entry["spread"] == pytest.approx([min(tok_s), max(tok_s)])
    assert rec["per_repeat"]["tpot_ms_p99"] is None or len(rec["per_repeat"]["tpot_ms_p99"]["samples"]) == 3
    assert rec["summary"]["num_ok"] == 9  # the pooled summary: every repeat's requests
    assert rec["summary"]["wall_s"] == pytest.approx(sum(s["wall_s"] for s in rec["repeats"]))


def result(
    i: int, ttft: float | None, tpot: float | None, tokens: int, error: str | None = None
) -> RequestResult:
    e2e = None if ttft is None else ttft + (tpot or 0.0) * (tokens - 1)
    return RequestResult(
        i, 0, 0.0, 10, prompt_tokens=50, output_tokens=tokens, num_chunks=tokens, ttft_ms=ttft, e2e_ms=e2e,
        tpot_ms=tpot, error=error,
    )  # fmt: skip


def test_goodput_counts_only_requests_meeting_every_slo_set() -> None:
    results = [
        result(0, 100.0, 20.0, 8),  # meets both
        result(1, 300.0, 20.0, 8),  # TTFT too slow
        result(2, 100.0, 60.0, 8),  # TPOT too slow
        result(3, 150.0, None, 1),  # one token: no TPOT to miss
        result(4, None, None, 0, error="http 503"),  # failed: never good, not in the figures
    ]
    empty = result(5, None, None, 3)  # answered with no text: ok, no TTFT, the whole answer as its first
    empty.e2e_ms = 120.0
    assert empty.is_ok and meets_slo(empty, 200.0, 50.0) and not meets_slo(empty, 100.0, None)
    assert summarize([empty], 1.0, None, None)["num_errors"] == 0
    both = summarize(results, 2.0, 200.0, 50.0)
    assert [meets_slo(r, 200.0, 50.0) for r in results] == [True, False, False, True, False]
    assert both["num_meeting_slo"] == 2 and both["goodput_requests_per_s"] == 1.0
    assert both["requests_per_s"] == 2.0 and both["num_errors"] == 1
    assert both["output_tok_s"] == (8 + 8 + 8 + 1) / 2.0
    assert summarize(results, 2.0, 200.0, None)["num_meeting_slo"] == 3  # TTFT only
    assert summarize(results, 2.0, None, 50.0)["num_meeting_slo"] == 3  # TPOT only
    assert summarize(results, 2.0, None, None)["goodput_requests_per_s"] is None
    assert both["ttft_ms"]["p50"] == 150.0 and both["tpot_ms"]["p99"] == 60.0


def test_a_streamed_tool_call_is_output_text() -> None:
    """A chunk of a tool call counts as output (its first one is the first token the user sees)."""
    call = {"index": 0, "id": "functions.get_weather:0", "type": "function"}
    first = {
        "choices": [
            {"delta": {"tool_calls": [call | {"function": {"name": "get_weather", "arguments": ""}}]}}
        ]
    }
    more = {"choices": [{"delta": {"tool_calls": [{"index": 0, "function": {"arguments": '{"city"'}}]}}]}
    assert text_of(first) == "get_weather" and text_of(more) == '{"city"'
    assert text_of({"choices": [{"delta": {"content": "hi"}}]}) == "hi" and text_of({"usage": {}}) == ""

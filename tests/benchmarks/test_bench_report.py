"""`kumo bench report`: the summary and serving tables (and the README's copies of them) regenerated
from records; the committed tables are what the generator writes for the committed records."""

from __future__ import annotations

import gzip
import json
import shutil
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cli import main as bench_main
from benchmarks.engine.method import summary_entry
from benchmarks.engine.report import merge
from benchmarks.report import (
    BEGIN,
    END,
    NO_MATPLOTLIB,
    SERVE_BEGIN,
    SERVE_END,
    block,
    find_records,
    is_met,
    serve_table,
    tables,
)
from benchmarks.serve import RequestResult, per_repeat, summarize

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
REGENERATE = "kumo bench report --results benchmarks/results --out-dir benchmarks/results --readme benchmarks/README.md"


@pytest.fixture(scope="module")
def records(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    out = tmp_path_factory.mktemp("records")
    cache = out / "triton"
    paths = []
    for name, extra in (("fp8kv_vs_bf16kv_c1", ["--rounds", "3"]), ("integrity_overhead", ["--rounds", "3"])):
        path = out / f"{name}.json"
        args = [
            "engine",
            "scenario",
            name,
            "--tiny",
            *extra,
            "--compile-cache",
            str(cache),
            "--out",
            str(path),
        ]
        assert bench_main(args) == 0
        paths.append(path)
    return paths


def test_the_table_is_the_records_summary_and_the_readme_block_is_replaced(
    records: list[Path], tmp_path: Path
) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# Title\n\nbefore\n{BEGIN}\nan old hand-typed table\n{END}\nafter\n")
    out = tmp_path / "report"
    assert bench_main(["report", *map(str, records), "--out-dir", str(out), "--readme", str(readme)]) == 0
    table = (out / "engine-summary.md").read_text()
    text = readme.read_text()
    assert text == f"# Title\n\nbefore\n{BEGIN}\n{table}{END}\nafter\n"
    c1 = json.loads(records[0].read_text())["summary"]["fp8kv_vs_bf16kv_c1"]
    row = next(line for line in table.splitlines() if line.startswith("| `fp8kv_vs_bf16kv_c1`"))
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells[1] == f"{c1['value']:.2f}x" and cells[3] == "3"
    assert cells[2] == f"[{c1['spread'][0]:.2f}x, {c1['spread'][1]:.2f}x]"
    assert cells[6] == ("yes" if c1["value"] >= 1.0 else "**no**")
    assert cells[7].startswith("kimi-k2.6, 2 of ") and cells[8] == "yes"  # the first process on the cache
    integrity = next(line for line in table.splitlines() if line.startswith("| `integrity_overhead`"))
    assert integrity.split("|")[9].strip() == "no"
    assert "| `capacity_fp8_over_bf16` | not measured |" in table


def test_a_readme_without_the_block_is_refused(records: list[Path], tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("no markers\n")
    with pytest.raises(SystemExit):
        bench_main(["report", str(records[0]), "--out-dir", str(tmp_path), "--readme", str(readme)])
    assert readme.read_text() == "no markers\n"


def test_the_plots_are_written_where_matplotlib_is(records: list[Path], tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert bench_main(["report", *map(str, records), "--out-dir", str(tmp_path)]) == 0
    for name in ("engine-summary.png", "engine-latency.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"
    shutil.rmtree(tmp_path)


def test_goals_are_read_as_bounds() -> None:
    assert is_met("k", 1.46, ">= 1.45x") and not is_met("k", 1.44, ">= 1.45x")
    assert is_met("integrity_overhead", 0.009, "<= +1%") and not is_met("integrity_overhead", 0.011, "<= +1%")
    assert is_met("k", 1.0, "-") is None


def serve_record(model: str, concurrency: int, ttfts: list[float]) -> dict[str, Any]:
    """A `kumo bench serve` record as `benchmarks.serve.main` writes it, from made-up requests."""
    results = [
        RequestResult(i, i % concurrency, 0.1 * i, 40, prompt_tokens=100, output_tokens=9, num_chunks=9,
                      ttft_ms=t, e2e_ms=t + 80.0, tpot_ms=10.0)
        for i, t in enumerate(ttfts)
    ]  # fmt: skip
    config = {
        "model": model,
        "concurrency": concurrency,
        "output_len": 16,
        "slo_ttft_ms": 200.0,
        "slo_tpot_ms": None,
    }
    return {
        "command": f"kumo bench serve --model {model} --concurrency {concurrency}",
        "date": "2026-12-04T11:00:00Z",
        "machine": {"cpu": "x", "num_cpus": 16, "note": "NVIDIA H200, kumo serve --device cuda"},
        "config": config,
        "summary": summarize(results, 2.0, 200.0, None),
        "requests": [asdict(r) for r in results],
    }


@pytest.fixture(scope="module")
def results_dir(records: list[Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A results folder as committed: scenario records, serve records, and records a summary skips."""
    out = tmp_path_factory.mktemp("results")
    for path in records:  # tiny records: marked as a real geometry so the folder's summary takes them
        record = json.loads(path.read_text())
        record["geometry"]["is_tiny"] = False
        (out / path.name).write_text(json.dumps(record))
    tiny = json.loads(records[0].read_text())
    (out / "a-tiny-one.json").write_text(json.dumps(tiny))
    side = json.loads(records[0].read_text())
    side["geometry"]["is_tiny"] = False
    side["scenarios"] = {k: dict(e, side="A") for k, e in side["scenarios"].items()}
    (out / "one-side.json").write_text(json.dumps(side))
    (out / "a-list.json").write_text("[1, 2]")
    for c, ttfts in ((1, [50.0, 60.0, 70.0]), (16, [150.0, 250.0, 350.0, 190.0])):
        (out / f"serve-c{c}.json").write_text(json.dumps(serve_record("@cf/zai-org/glm-5.2", c, ttfts)))
    return out


def test_a_results_folder_gives_its_scenario_and_serve_records(results_dir: Path, tmp_path: Path) -> None:
    engine, serve = find_records(results_dir)
    assert [n for n, _ in engine] == ["fp8kv_vs_bf16kv_c1.json", "integrity_overhead.json"]
    assert [n for n, _ in serve] == ["serve-c1.json", "serve-c16.json"]
    readme = tmp_path / "README.md"
    readme.write_text(f"{BEGIN}\nold\n{END}\nmiddle\n{SERVE_BEGIN}\nold rows\n{SERVE_END}\n")
    out = tmp_path / "report"
    assert (
        bench_main(["report", "--results", str(results_dir), "--out-dir", str(out), "--readme", str(readme)])
        == 0
    )
    engine_table, serve_table = tables(engine, serve)
    assert (out / "engine-summary.md").read_text() == engine_table
    assert (out / "serve-summary.md").read_text() == serve_table
    assert (
        readme.read_text()
        == f"{BEGIN}\n{engine_table}{END}\nmiddle\n{SERVE_BEGIN}\n{serve_table}{SERVE_END}\n"
    )
    rows = [line for line in serve_table.splitlines() if line.startswith("| @cf/")]
    c16 = [c.strip() for c in rows[1].split("|")[1:-1]]
    assert c16[1] == "16" and c16[4] == "4/4" and c16[7] == "250 / 350"  # nearest-rank p50, p99 of the TTFTs
    assert c16[10] == "1.00" and c16[12] == "200 / -"  # 2 of 4 within TTFT 200 ms over 2 s
    assert c16[11] == "1 sample"  # one measured window, no --repeats
    assert "NVIDIA H200, kumo serve --device cuda" in serve_table


def test_a_repeated_serve_record_in_a_run_folder_shows_its_median_and_spread(tmp_path: Path) -> None:
    """`kumo bench serve --repeats 3` records, kept in one run's folder: the row gives each repeated
    figure as the median of the repeats with their range, and a single window says it is one sample."""
    windows = [[50.0, 60.0], [90.0, 95.0], [70.0, 75.0]]  # TTFTs of each repeat's two requests
    repeats = [serve_record("@cf/moonshotai/kimi-k2.6", 2, ttfts)["summary"] for ttfts in windows]
    for s, wall in zip(repeats, (2.0, 4.0, 1.0), strict=True):  # out tok/s 9, 4.5, 18 (2 x 9 tokens)
        s["output_tok_s"] = 18 / wall
    record = serve_record("@cf/moonshotai/kimi-k2.6", 2, [t for w in windows for t in w])
    record |= {"repeats": repeats, "per_repeat": per_repeat(repeats)}
    (tmp_path / "2026-12-05-serve-h200").mkdir()
    (tmp_path / "2026-12-05-serve-h200" / "serve-kimi-c2.json").write_text(json.dumps(record))
    (tmp_path / "serve-c1.json").write_text(json.dumps(serve_record("@cf/zai-org/glm-5.2", 1, [50.0])))
    engine, serve = find_records(tmp_path)
    assert [n for n, _ in serve] == ["2026-12-05-serve-h200/serve-kimi-c2.json", "serve-c1.json"]
    rows = [line for line in tables(engine, serve)[1].splitlines() if line.startswith("| @cf/")]
    # nearest-rank p50 of each repeat's two TTFTs (the upper one): 60, 95, 75 -> median 75 [60, 95]
    assert "| 3 x: 9.0 [4.5, 18.0]; 75 [60, 95]; 10.0 [10.0, 10.0] |" in rows[0]
    assert "| 1 sample |" in rows[1]


def test_a_gzipped_serve_record_reads_as_its_json(results_dir: Path, tmp_path: Path) -> None:
    """Serve records with every request's timings are committed as `NAME.json.gz`: found in a folder and
    named alike, they give the rows the plain JSON gives."""
    record = serve_record("@cf/zai-org/glm-5.2", 2, [50.0, 60.0, 70.0])
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir(), packed.mkdir()
    (plain / "serve-c2.json").write_text(json.dumps(record))
    (packed / "serve-c2.json.gz").write_bytes(gzip.compress(json.dumps(record).encode()))
    _, serve_plain = find_records(plain)
    _, serve_packed = find_records(packed)
    assert [n for n, _ in serve_packed] == ["serve-c2.json.gz"]
    assert serve_packed[0][1] == serve_plain[0][1] == json.loads(json.dumps(record))
    assert serve_table(serve_packed) == serve_table(serve_plain).replace("serve-c2.json", "serve-c2.json.gz")
    named = [str(results_dir / "fp8kv_vs_bf16kv_c1.json"), str(packed / "serve-c2.json.gz")]
    assert bench_main(["report", *named, "--out-dir", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out" / "serve-summary.md").read_text() == serve_table(serve_packed)


def test_named_records_and_a_folder_give_the_same_tables(results_dir: Path, tmp_path: Path) -> None:
    named = [
        str(results_dir / n)
        for n in ("fp8kv_vs_bf16kv_c1.json", "integrity_overhead.json", "serve-c1.json", "serve-c16.json")
    ]
    assert bench_main(["report", *named, "--out-dir", str(tmp_path / "a")]) == 0
    assert bench_main(["report", "--results", str(results_dir), "--out-dir", str(tmp_path / "b")]) == 0
    for name in ("engine-summary.md", "serve-summary.md"):
        assert (tmp_path / "a" / name).read_text() == (tmp_path / "b" / name).read_text()


def test_without_matplotlib_the_tables_are_written_and_the_plots_skipped_with_a_message(
    results_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert bench_main(["report", "--results", str(results_dir), "--out-dir", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine-summary.md", "serve-summary.md"]
    assert NO_MATPLOTLIB in capsys.readouterr().err


def test_the_serve_plots_are_written_where_matplotlib_is(results_dir: Path, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    assert bench_main(["report", "--results", str(results_dir), "--out-dir", str(tmp_path)]) == 0
    for name in ("serve-throughput.png", "serve-latency.png"):
        assert (tmp_path / name).read_bytes()[:4] == b"\x89PNG"


def test_the_committed_tables_are_what_the_generator_writes_for_the_committed_records() -> None:
    """A hand edit of a table, or a record committed without regenerating them, fails here."""
    engine, serve = find_records(RESULTS)
    engine_table, serve_table = tables(engine, serve)
    readme = (ROOT / "benchmarks" / "README.md").read_text()
    assert block(readme, BEGIN, END) == engine_table, f"benchmarks/README.md's summary is stale: {REGENERATE}"
    assert block(readme, SERVE_BEGIN, SERVE_END) == serve_table, f"its serving table is stale: {REGENERATE}"
    assert (RESULTS / "engine-summary.md").read_text() == engine_table, REGENERATE
    assert (RESULTS / "serve-summary.md").read_text() == serve_table, REGENERATE


def test_where_records_of_a_key_differ_in_depth_the_deepest_is_the_summary(records: list[Path]) -> None:
    shallow = json.loads(records[0].read_text())
    deep = json.loads(records[0].read_text())
    deep["geometry"]["num_layers"] += 1  # another measurement: one round, deeper
    entry = deep["scenarios"]["fp8kv_vs_bf16kv_c1"]
    entry["rounds"], entry["summary"] = entry["rounds"][:1], summary_entry([0.5])
    deep["command"] += " --layers 3"
    for order in ([shallow, deep], [deep, shallow]):
        merged = merge(order)
        assert merged["summary"]["fp8kv_vs_bf16kv_c1"]["samples"] == [0.5]
        assert merged["scenarios"]["fp8kv_vs_bf16kv_c1"]["not_pooled"] == [shallow["command"]]
    same_depth = json.loads(json.dumps(deep))
    same_depth["geometry"]["num_layers"] = shallow["geometry"]["num_layers"]
    same_depth["scenarios"]["fp8kv_vs_bf16kv_c1"]["workload"]["output_len"] += 1  # not poolable with it
    merged = merge([shallow, same_depth])  # at one depth: the most rounds
    assert merged["summary"]["fp8kv_vs_bf16kv_c1"] == shallow["summary"]["fp8kv_vs_bf16kv_c1"]


def test_a_record_at_the_scenarios_own_workload_wins_over_a_deeper_cut_one(records: list[Path]) -> None:
    """The long scenario measured at 4 layers with its output cut to 1,024 tokens, and at 2 layers at
    its own 64 x 16,384 / 4,096: the summary is the latter's, the former named as not pooled."""
    cut = json.loads(records[0].read_text())
    own = json.loads(records[0].read_text())
    for record, layers, output_len, value in ((cut, 4, 1024, 1.01), (own, 2, 4096, 1.4)):
        entry = record["scenarios"].pop("fp8kv_vs_bf16kv_c1")
        entry["workload"] |= {"concurrency": 64, "input_len": 16384, "output_len": output_len}
        entry["rounds"], entry["summary"] = entry["rounds"][:1], summary_entry([value])
        record["scenarios"]["fp8kv_vs_bf16kv_long_c64"] = entry
        record["geometry"]["num_layers"] = layers
        record["command"] += f" --layers {layers} --output-len {output_len}"
    for order in ([cut, own], [own, cut]):
        merged = merge(order)
        assert merged["summary"]["fp8kv_vs_bf16kv_long_c64"]["samples"] == [1.4]
        assert merged["scenarios"]["fp8kv_vs_bf16kv_long_c64"]["not_pooled"] == [cut["command"]]


def test_rounds_of_one_key_on_another_device_are_not_pooled(records: list[Path]) -> None:
    """One key measured at one depth and workload on an H200 and on an H100: the rounds are not one
    measurement (the summary once read "H200" over both); the one with more rounds is the summary
    and the other is named as not pooled."""
    h200 = json.loads(records[0].read_text())
    h100 = json.loads(records[0].read_text())
    h100["device"] = "NVIDIA H100 80GB HBM3"
    assert h100["device"] != h200["device"]
    entry = h100["scenarios"]["fp8kv_vs_bf16kv_c1"]
    entry["rounds"], entry["summary"] = entry["rounds"][:1], summary_entry([0.5])
    h100["command"] += " --on-an-h100"
    for order in ([h200, h100], [h100, h200]):
        merged = merge(order)
        assert merged["summary"]["fp8kv_vs_bf16kv_c1"] == h200["summary"]["fp8kv_vs_bf16kv_c1"]
        assert merged["scenarios"]["fp8kv_vs_bf16kv_c1"]["not_pooled"] == [h100["command"]]
        assert merged["scenarios"]["fp8kv_vs_bf16kv_c1"]["measured_on"]["device"] == h200["device"]

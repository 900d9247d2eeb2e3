"""`kumo bench report`: the summary table (and the README's copy of it) regenerated from records."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from benchmarks.cli import main as bench_main
from benchmarks.report import BEGIN, END, is_met


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

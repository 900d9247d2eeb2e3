"""lab/device/r6_long.sh and r6_bench.sh, checked on the CPU before a device call spends its minutes:
every command they would run parses, keeps its scenario's point and >= 3 rounds or repeats inside the
call's 540 s, and the long scenario's warm-up plan holds at full size."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from backend.tools.random_geometry import parser as geometry_parser
from benchmarks.engine import method, warm_plan
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.scenario_cli import parser as scenario_parser
from benchmarks.engine.scenarios import SCENARIOS
from benchmarks.serve import parser as serve_parser

ROOT = Path(__file__).resolve().parents[2]
DEVICE = ROOT / "lab" / "device"
LIMIT, EXIT_S = 540, 20


def commands(script: str, tmp_path: Path, *stage: str, **env: str) -> list[list[str]]:
    """The commands the script would run on the device (DRY=1 prints them, one a line)."""
    done = subprocess.run(
        ["bash", str(DEVICE / script), *stage], cwd=ROOT, capture_output=True, text=True, check=True,
        env=dict(os.environ, DRY="1", OUT=str(tmp_path), LOGS=str(tmp_path / "logs"), **env),
    )  # fmt: skip
    return [shlex.split(line) for line in done.stdout.splitlines() if not line.startswith("==")]


def test_the_long_call_runs_the_full_workload_at_two_layers_with_a_planned_warm_up(tmp_path: Path) -> None:
    [argv] = commands("r6_long.sh", tmp_path)
    a = scenario_parser().parse_args(argv[5:])
    scenario = SCENARIOS[a.name]
    assert a.name == "fp8kv_vs_bf16kv_long_c64" and a.rank_of == 8 and a.layers == 2 and not a.tiny
    assert (scenario.concurrency, scenario.input_len, scenario.output_len) == (64, 16384, 4096)
    assert a.concurrency is a.input_len is a.output_len is None and a.pool_scale == 1.0  # the scenario's own
    assert a.rounds >= 3 and a.warm_up_lengths == [16384, 1024]
    assert a.budget_s <= LIMIT - EXIT_S
    # capacity, the scenario's point, is the full deployment's per-GPU pool at any depth
    per_request = scenario.input_len + scenario.output_len
    for layers in (2, 4, 61):
        geometry = make_geometry("kimi-k2.6", layers, rank_of=8)
        fp8 = geometry.kv_sizing(scenario.a.weights, scenario.a.kv_dtype).kv_tokens
        bf16 = geometry.kv_sizing(scenario.b.weights, scenario.b.kv_dtype).kv_tokens
        assert (fp8, bf16) == (1_364_736, 682_368) and fp8 // per_request >= 64 > bf16 // per_request


@pytest.mark.slow
def test_at_full_size_the_planned_warm_up_needs_one_probe() -> None:
    """The scheduler's plan of the timed 4,096-token runs against the 1,024-token warm-up pass, at the
    rank-of-8 pools: what lab/device/r6_long.sh's header says (FP8 misses nothing, BF16 one shape)."""
    missed = {}
    for label, pool in (("fp8", 1_364_736), ("bf16", 682_368)):
        sizes = {
            "num_pages": pool // 16,
            "page_size": 16,
            "concurrency": 64,
            "chunk": 2048,
            "input_len": 16384,
        }
        timed = warm_plan.planned_shapes(**sizes, output_len=4096)
        warm = warm_plan.planned_shapes(**sizes, output_len=1024)
        missed[label] = (len(timed), method.missing_shapes(warm, timed))
    assert missed == {"fp8": (129, []), "bf16": (83, [[1347, 31]])}


def test_the_engine_call_runs_glm_decode_at_rank_of_8_then_the_transformers_peer(tmp_path: Path) -> None:
    decode, peer = (
        scenario_parser().parse_args(argv[5:]) for argv in commands("r6_bench.sh", tmp_path, "engine")
    )
    assert (decode.name, decode.rank_of, decode.layers, decode.rounds) == ("int4_vs_fp8_decode_c1", 8, 50, 3)
    assert decode.cuda_graphs and not decode.experts_only  # every Linear but routers and lm_head, graphs on
    assert (peer.name, peer.rounds, peer.hf_mode, peer.layers) == ("vs_transformers_c64", 3, "generate", None)
    assert SCENARIOS[peer.name].layers == 3  # the depth transformers fits beside Kumo
    assert decode.budget_s + 250 <= LIMIT - EXIT_S  # the peer's minimum is left after the decode's budget


def test_a_scenario_that_no_longer_fits_is_skipped_and_said_so(tmp_path: Path) -> None:
    """LIMIT 300: the decode keeps its 150 s, the peer gets the 280 s left; LIMIT 200: 180 s is below
    the peer's 250 s minimum, so it is skipped with the seconds left and needed."""
    done = subprocess.run(
        ["bash", str(DEVICE / "r6_bench.sh"), "engine"], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, DRY="1", LIMIT="300", OUT=str(tmp_path), LOGS=str(tmp_path / "logs")),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    budgets = {line.split()[5]: line.split()[-3] for line in done.stdout.splitlines() if "--budget-s" in line}
    assert budgets == {"int4_vs_fp8_decode_c1": "150", "vs_transformers_c64": "280"}  # the peer: what is left
    done = subprocess.run(
        ["bash", str(DEVICE / "r6_bench.sh"), "engine"], cwd=ROOT, capture_output=True, text=True,
        env=dict(os.environ, DRY="1", LIMIT="200", OUT=str(tmp_path), LOGS=str(tmp_path / "logs")),
    )  # fmt: skip
    assert "== vs_transformers_c64: skipped, 180s left of the call (it needs 250s)" in done.stdout


def test_the_serve_call_writes_both_geometries_and_benches_every_model_three_times(tmp_path: Path) -> None:
    kimi, glm, server, *benches = commands("r6_bench.sh", tmp_path, "serve")
    written = {}
    for argv in (kimi, glm):
        g = geometry_parser().parse_args(argv[3:])
        assert g.device == "cuda"
        written[g.kind] = (g.layers, str(g.path))
    assert {k: v[0] for k, v in written.items()} == {"kimi-k2.6": 2, "glm-5.2": 4}
    assert server[1:4] == ["-m", "gateway.cli", "serve"] and server[server.index("--device") + 1] == "cuda"
    served = dict(server[i + 1].split("=", 1) for i, arg in enumerate(server) if arg == "--model")
    assert sorted(served.values()) == sorted(path for _, path in written.values())
    parsed = [serve_parser().parse_args(argv[4:]) for argv in benches]
    nano = {"@cf/moonshotai/kimi-k2.6", "@cf/zai-org/glm-5.2"}
    assert {a.model for a in parsed} == nano | set(served)
    for a in parsed:
        assert a.repeats >= 3 and a.duration and a.slo_ttft_ms and a.slo_tpot_ms
        if a.model in served:  # a `--model` backend's default pool: 1,024 pages of 16 tokens
            assert a.concurrency * (a.input_len + a.output_len) <= 1024 * 16
    assert (
        sorted((a.model in nano, a.concurrency) for a in parsed)
        == [(False, 1)] * 2 + [(False, 8)] * 2 + [(True, 1)] * 2 + [(True, 16)] * 2
    )
    assert [a.concurrency for a in parsed[:4]] == [1, 1, 1, 1]  # every model's c=1 first


def test_at_tiny_scale_the_long_call_writes_its_record_into_one_archive(tmp_path: Path) -> None:
    out, logs = tmp_path / "out", tmp_path / "logs"
    env = dict(
        os.environ, TINY="1", OUT=str(out), LOGS=str(logs), PYTHON=sys.executable, PYTHONPATH=str(ROOT)
    )
    done = subprocess.run(
        ["bash", str(DEVICE / "r6_long.sh")], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert "== fp8kv_vs_bf16kv_long_c64 rc=0" in done.stdout and "it ran every step shape" in done.stdout
    assert sorted(p.name for p in out.iterdir()) == ["r6_long.tgz"]
    with tarfile.open(out / "r6_long.tgz") as tar:
        names = set(tar.getnames())
        assert {f"./fp8kv_vs_bf16kv_long_c64.{ext}" for ext in ("json", "md", "log")} <= names
        record = json.load(tar.extractfile("./fp8kv_vs_bf16kv_long_c64.json"))  # type: ignore[arg-type]
    entry = record["scenarios"]["fp8kv_vs_bf16kv_long_c64"]
    assert len(entry["rounds"]) == 3 and entry["warm_up_missed_shapes"] == {"A": [], "B": []}
    assert all(w["plan_matched_timed"] for w in entry["warm_up"].values())

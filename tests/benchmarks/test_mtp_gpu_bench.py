"""`kumo bench engine mtp` end to end at --tiny scale on the CPU (a subprocess: the projection joins a
local process group): A/B/B/A rounds whose ratios are the runs' own figures, identical greedy outputs
on both sides, and a projection whose numbers follow from its measured step times."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from backend.engine.speculative.policy import SPEC_PROBE_STEPS
from benchmarks.engine.mtp_gpu import refusals

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def record(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("mtp") / "rec.json"
    argv = ["--tiny", "--models", "models/kimi-k2.6-nano", "--tasks", "tool-call", "--c64", "4"]
    argv += ["--depths", "2,3", "--budget-s", "400", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks.cli", "engine", "mtp", *argv]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=600)
    return json.loads(out.read_text())


def test_rounds_and_ratios(record: dict[str, Any]) -> None:
    m = record["models"]["kimi-k2.6-nano"]
    for part, metric in (
        (m["speedup_c1"]["tool-call"], "decode_tok_s_per_user"),
        (m["throughput_c64"], "output_tok_s"),
    ):
        assert part["metric"] == metric and part["greedy_outputs_identical"] is True
        assert part["order"] == ["A", "B", "B", "A"] and part["rounds_skipped"] == 0
        (r,) = part["rounds"]
        a = [run[metric] for run in r["runs"] if run["side"] == "A"]
        b = [run[metric] for run in r["runs"] if run["side"] == "B"]
        assert r["ratio"] == pytest.approx(sum(a) / sum(b))
        assert part["summary"]["value"] == r["ratio"]
        for run in r["runs"]:  # off never drafted; on (adaptive) probes a load first where its prior
            # says drafting pays, later only within a share of its plain time
            # (backend/engine/speculative/policy.py): at most the first probe of each load (1, 2, 4
            # sequences) in runs this short, begun here or in the warm-up
            if run["side"] == "B":
                assert run["verify_steps"] == 0 and run["drafting_steps"] == 0 and run["policy_probes"] == 0
            else:
                assert run["policy_probes"] <= 3 and run["drafting_steps"] <= 3 * SPEC_PROBE_STEPS
            assert run["max_drafting_seqs"] > 0 if run["side"] == "A" else run["max_drafting_seqs"] == 0
            assert run["output_tokens"] > 0
            assert sum(run["steps_by_draft_length"].values()) == run["steps"]
            kinds = run["step_ms_by_kind"]  # every step in one kind; prompts prefilled, decodes after
            assert sum(x["steps"] for x in kinds.values()) == run["steps"]
            assert kinds.get("drafting", {}).get("steps", 0) == run["drafting_steps"]
            if run["side"] == "B":  # plain: its prompts' steps, then decodes
                assert set(kinds) == {"decode", "prompt"}
            for x in kinds.values():
                assert 0 < x["median_ms"] <= x["sum_ms"] < run["wall_s"] * 1e3
            slowest = run["slowest_steps"]  # the run's slowest steps, slowest first, of its kinds
            assert 0 < len(slowest) <= min(6, run["steps"]) and {x["kind"] for x in slowest} <= set(kinds)
            assert [x["ms"] for x in slowest] == sorted((x["ms"] for x in slowest), reverse=True)
            assert (
                slowest[0]["ms"]
                == max(x["ms"] for x in slowest)
                >= max(x["median_ms"] for x in kinds.values()) - 1e-3
            )
        fixed = part["fixed_k_run"]  # the policy off: K drafts whenever a sequence can draft
        assert fixed["verify_steps"] > 0 and set(fixed["steps_by_draft_length"]) <= {"0", "3"}
        assert fixed["greedy_steps"] > 0  # greedy rows without logprobs: whole steps on the device
        b = [run[metric] for run in r["runs"] if run["side"] == "B"]
        assert fixed["over_B_of_last_round"] == pytest.approx(fixed[metric] / (sum(b) / 2))
    assert record["summary"]["speedup_c1 kimi-k2.6-nano tool-call"] == m["speedup_c1"]["tool-call"]["summary"]


def test_projection_follows_from_its_step_times(record: dict[str, Any]) -> None:
    p = record["projection_glm_5.2"]
    assert p["label"].startswith("projection") and p["rank_of"] == 2 and p["full_depth"] == 78
    depths = p["depths_measured"]
    assert depths == [2, 3]
    t = {d: p["step_ms_measured"][str(d)] for d in depths}
    assert set(t[3]) == {"plain", "spec_k1", "spec_k2", "spec_k3"}
    # medians over the timed runs' steady steps (several runs of a few steps each at --tiny)
    assert all(n >= 3 for depth in p["steps_timed"].values() for n in depth.values())
    for key, full in p["step_ms_full_depth"].items():  # the least-squares line through the depths
        slope, at_zero = statistics.linear_regression(depths, [t[d][key] for d in depths])
        assert full == pytest.approx(slope * 78 + at_zero)
        assert p["fitted_ms_per_layer"][key] == pytest.approx(slope)
        assert full == pytest.approx(t[3][key] + (t[3][key] - t[2][key]) * (78 - 3))  # two depths: their line
    e = p["acceptance_length_used"]
    # the nano GLM's acceptance comes from the committed CPU record (benchmarks/engine/mtp_acceptance.py)
    committed = json.loads((Path(__file__).parents[2] / "benchmarks/results/2026-12-05-mtp.json").read_text())
    tool_call = committed["models"]["glm-5.2-nano"]["tool-call"]["acceptance_length"]
    assert e["GLM 5.2 published (3 drafts)"] == 2.69 and e["glm-5.2-nano tool-call"] == tool_call
    full = p["step_ms_full_depth"]
    # CPU times at two tiny depths may well not be monotonic: then the record refuses, saying why
    assert p["refused"] == refusals(
        {
            int(d): {k: {"ms": ms, "graphs": p["graphs"][d][k]} for k, ms in v.items()}
            for d, v in p["step_ms_measured"].items()
        },
        full,
    )
    if p["refused"]:
        assert p["projected_speedup_c1"] is None
        assert record["summary"]["projected speedup_c1 GLM 5.2"].startswith("refused: ")
        return
    for name, value in p["projected_speedup_c1"].items():
        assert value == pytest.approx(e[name] * full["plain"] / full["spec_k3"])


def times(ms: dict[int, list[float]], graphs: str = "captured") -> dict[int, dict[str, dict[str, Any]]]:
    keys = ("plain", "spec_k1", "spec_k2", "spec_k3")
    return {d: {k: {"ms": t, "graphs": graphs} for k, t in zip(keys, v, strict=True)} for d, v in ms.items()}


def test_a_projection_from_non_monotonic_or_eager_steps_is_refused() -> None:
    """2026-12-05's H100 record: k = 3 took 20.7 ms at 8 layers against 2.4 at 4 (its verify graphs
    had failed to capture), and the projection said 0.06x. Such times are refused, with the reason."""
    r12 = times({4: [0.816, 1.554, 1.997, 2.379], 8: [1.341, 2.321, 2.779, 20.687]})
    full = {"plain": 10.54, "spec_k1": 15.74, "spec_k2": 16.47, "spec_k3": 341.08}
    # 4.577 ms per layer for a verify of 4 rows, where a plain row costs 0.131
    assert refusals(r12, full) == [
        "spec_k3: 4.577 ms per layer, over 4 × plain's 0.131 (its verify's 4 rows)"
    ]
    r12[8]["spec_k3"]["graphs"] = "eager verify: AcceleratorError: CUDA error: operation failed"
    assert refusals(r12, full) == [
        "spec_k3 at 8 layers ran eagerly (eager verify: AcceleratorError: CUDA error: operation failed)"
    ]
    sound = times({4: [0.8, 1.5, 2.0, 2.4], 8: [1.3, 2.3, 2.8, 3.3]})
    assert refusals(sound, {"plain": 10.0, "spec_k1": 15.0, "spec_k2": 16.0, "spec_k3": 17.0}) == []
    shallower = times({4: [0.8, 1.5, 2.0, 2.4], 8: [1.3, 2.3, 2.8, 2.3]})
    reasons = refusals(shallower, {"plain": 10.0, "spec_k1": 15.0, "spec_k2": 16.0, "spec_k3": 1.0})
    assert reasons == [
        "spec_k3: 2.300 ms at 8 layers, not above 2.400 at 4",
        "at 8 layers, spec_k3 (2.300 ms) not above spec_k2 (2.800 ms)",
        "at the full depth, spec_k3 (1.000 ms) not above spec_k2 (16.000 ms)",
    ]
    untimed = times({4: [0.8, 1.5, 2.0, 2.4], 8: [1.3, 2.3, 2.8, 3.3]})
    untimed[4]["spec_k2"]["ms"] = None
    assert refusals(untimed, {}) == ["spec_k2 at 4 layers: no steady step timed"]


def test_a_step_bound_by_the_host_at_shallow_depths_is_refused() -> None:
    """Session 13's H100 record at 4 and 8 layers: k = 3 grew 0.195 ms a layer against k = 1's 0.242,
    its 4-layer step bound by the host (~2 ms of it a step) rather than by the device. Two depths
    cannot tell; a third, deeper one shows the bend, and the projection is refused."""
    bent = times(
        {
            4: [0.828, 1.490, 1.873, 2.492],
            8: [1.560, 2.459, 2.913, 3.273],
            16: [3.024, 4.400, 4.990, 5.600],
        }
    )
    depths = [4, 8, 16]
    full = {key: 0.0 for key in ("plain", "spec_k1", "spec_k2", "spec_k3")}
    for key in full:
        slope, at_zero = statistics.linear_regression(depths, [bent[d][key]["ms"] for d in depths])
        full[key] = slope * 78 + at_zero
    reasons = refusals(bent, full)
    assert reasons == [
        "spec_k3: ms per layer 0.195 from 4 to 8, 0.291 from 8 to 16: not one line (bound by the host at some depths?)"
    ]
    straight = times(  # every kind's cost a layer within a few percent: it stands
        {d: [0.1 + 0.183 * d, 1.0 + 0.2 * d, 1.2 + 0.21 * d * 1.01, 1.5 + 0.22 * d] for d in depths}
    )
    full = {key: 0.0 for key in ("plain", "spec_k1", "spec_k2", "spec_k3")}
    for key in full:
        slope, at_zero = statistics.linear_regression(depths, [straight[d][key]["ms"] for d in depths])
        full[key] = slope * 78 + at_zero
    assert refusals(straight, full) == []


def test_a_projection_measured_at_the_full_depth_uses_its_times_as_they_are(tmp_path: Path) -> None:
    """`--depths full`: the whole depth of rank 0 measured (on the H100, GLM 5.2's INT4 experts fit
    one rank of 8), no line fitted; the nano models skipped (`--models ""`)."""
    out = tmp_path / "full.json"
    argv = ["--tiny", "--models", "", "--depths", "full", "--budget-s", "400", "--out", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "benchmarks.cli", "engine", "mtp", *argv]
    subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=600)
    record = json.loads(out.read_text())
    assert record["models"] == {}
    p = record["projection_glm_5.2"]
    assert p["depths_measured"] == [p["full_depth"]] == [78] and p["fitted_ms_per_layer"] is None
    measured = p["step_ms_measured"]["78"]
    assert p["step_ms_full_depth"] == measured and set(measured) == {"plain", "spec_k1", "spec_k2", "spec_k3"}
    assert p["how"].startswith("step times measured at the full depth")
    graphs = {k: {"ms": ms, "graphs": p["graphs"]["78"][k]} for k, ms in measured.items()}
    assert p["refused"] == refusals({78: graphs}, measured)
    if p["refused"]:  # CPU times of a tiny model need not grow with the drafts
        assert p["projected_speedup_c1"] is None
        return
    e = p["acceptance_length_used"]
    for name, value in p["projected_speedup_c1"].items():
        assert value == pytest.approx(e[name] * measured["plain"] / measured["spec_k3"])


def test_one_depth_is_refused_only_for_what_it_shows() -> None:
    """At one depth there is no line to check: the drafts' order and the graphs still are."""
    one = times({78: [10.0, 12.0, 13.0, 14.0]})
    assert refusals(one, {"plain": 10.0, "spec_k1": 12.0, "spec_k2": 13.0, "spec_k3": 14.0}) == []
    one[78]["spec_k3"]["ms"] = 12.5
    assert refusals(one, {"plain": 10.0, "spec_k1": 12.0, "spec_k2": 13.0, "spec_k3": 12.5}) == [
        "at 78 layers, spec_k3 (12.500 ms) not above spec_k2 (13.000 ms)",
        "at the full depth, spec_k3 (12.500 ms) not above spec_k2 (13.000 ms)",
    ]

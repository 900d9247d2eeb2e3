"""`kumo bench engine scenario ... --rank-of N`: rank 0's slice at full depth, its collectives local.

Each check runs in its own process: joining the local process group is for the life of a process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.rank_of import ring_sent, summarize

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(
    os.environ,
    OMP_NUM_THREADS="1",
    PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
)

LOCAL_OPS = """
import torch, torch.distributed as dist
from backend.models.layers.parallel import all_gather_flat, reduce_scatter_flat
from benchmarks.engine.rank_of import join_alone
pg = join_alone(4)
assert (dist.get_rank(), dist.get_world_size()) == (0, 4)
x = torch.arange(6.0)
dist.all_reduce(x)
assert x.tolist() == list(range(6))  # rank 0's partial sum stands in for the sum
out = torch.empty(12)
all_gather_flat(out, torch.tensor([1.0, 2.0, 3.0]))
assert out.tolist() == [1.0, 2.0, 3.0] * 4
part = torch.empty(2)
reduce_scatter_flat(part, torch.ones(8))
assert part.tolist() == [4.0, 4.0]
assert pg.calls == [("all_reduce", 24), ("all_gather", 48), ("reduce_scatter", 32)], pg.calls
"""


def test_collectives_are_local_ops_of_the_same_size() -> None:
    subprocess.run([sys.executable, "-c", LOCAL_OPS], env=ENV, check=True, cwd=ROOT, timeout=120)


# rank 0 of 4 (tiny geometry, 2 layers) with decode graphs on and off: the same greedy tokens (up to a
# near-tie, test_decode_graphs_cuda.py's rule), every pure-decode step replayed, and a replayed step
# calls no collective from Python (the local stand-ins ran once, at capture, and sit in the graph)
GRAPHS = """
import statistics, sys, torch
from backend.engine.engine import Engine
from benchmarks.engine.geometry import make_geometry
from benchmarks.engine.offline import engine_config
from benchmarks.engine.rank_of import join_alone
from benchmarks.engine.weights import build_random_model
from tests.backend.engine.test_decode_graphs_cuda import NUM_TOKENS, assert_same_greedy, requests, run_timed
kind, weights = sys.argv[1], sys.argv[2]
pg = join_alone(4)
geometry = make_geometry(kind, 2, tiny=True, rank_of=4)
model = build_random_model(geometry, weights, device="cuda")
vocab = geometry.model_config.vocab_size
def engine(graphs):
    config = engine_config(256, 16, "bf16", 8, 512, cuda_graphs=graphs)
    return Engine(model, config, vocab_size=vocab, context_window=256, model_dtype=torch.bfloat16, device="cuda")
eager, graphed = engine(False), engine(True)
graphs = graphed.runner.graphs
assert eager.runner.graphs is None and graphs is not None
assert graphs.is_enabled, graphs.disabled_reason
for num_seqs in (1, 3, 8):
    replays = graphs.num_replays
    want, eager_s = run_timed(eager, requests(num_seqs, vocab, "eager"))
    got, graph_s = run_timed(graphed, requests(num_seqs, vocab, "graph"))
    assert graphs.num_replays - replays >= NUM_TOKENS - 2, graphs.num_replays - replays
    agreed = sum(assert_same_greedy(want[r], got[r], f"{kind} {weights} B={num_seqs} {r}") for r in want)
    print(f"{kind} {weights} rank 0 of 4, B={num_seqs}: eager {1e3 * statistics.median(eager_s):.2f} ms/step, "
          f"graphs {1e3 * statistics.median(graph_s):.2f} ms/step; tokens agreed {agreed}/{NUM_TOKENS * num_seqs}")
def decode_step_calls(engine):
    for req in requests(2, vocab, f"calls-{engine.runner.graphs is not None}"):
        engine.add_request(req)
    engine.step()  # both prompts (17 and 28 tokens) in one prefill step
    calls = len(pg.calls)
    engine.step()  # a pure-decode step
    return len(pg.calls) - calls
replays = graphs.num_replays
assert decode_step_calls(graphed) == 0 and graphs.num_replays == replays + 1
assert decode_step_calls(eager) == 1 + 2 * geometry.num_layers + 1  # all-reduces, the logits' all-gather
"""


@pytest.mark.gpu
@pytest.mark.parametrize(("kind", "weights"), [("glm-5.2", "int4-all"), ("kimi-k2.6", "bf16")])
def test_rank_of_decode_replays_cuda_graphs(kind: str, weights: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", GRAPHS, kind, weights],
        env=ENV,
        cwd=ROOT,
        timeout=600,
        capture_output=True,
        text=True,
    )
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-4000:]


def test_ring_model() -> None:
    # an all-reduce of n bytes over 8 ranks sends 2·7/8·n per rank; an all-gather 7/8 of the gathered size
    assert ring_sent("all_reduce", 800, 8) == 1400
    assert ring_sent("all_gather", 800, 8) == 700
    s = summarize(
        [("all_reduce", 900), ("all_reduce", 900), ("all_gather", 300)], 4, gbps=1.0, latency_us=0.0
    )
    assert s["by_collective"]["all_reduce"] == {
        "calls": 2,
        "payload_bytes": 1800,
        "sent_bytes": 2700.0,
        "modelled_s": pytest.approx(2.7e-6),
    }
    assert s["total"]["sent_bytes"] == 2700.0 + 225.0


def test_full_depth_geometry_keeps_the_published_dense_layers() -> None:
    g = make_geometry("glm-5.2", None, rank_of=8)
    assert g.num_layers == g.full_num_layers == 78
    assert g.text["first_k_dense_replace"] == 3 and g.plan_tp == 8
    assert make_geometry("kimi-k2.6", None, rank_of=8).num_layers == 61
    assert make_geometry("glm-5.2", 4).text["first_k_dense_replace"] == 1  # truncated: one dense layer


@pytest.mark.parametrize(
    ("kind", "device"),
    [
        ("int4_vs_fp8_decode_c1", "cpu"),
        ("fp8kv_vs_bf16kv_long_c64", "cpu"),
        pytest.param("fp8kv_vs_bf16kv_long_c64", "cuda", marks=pytest.mark.gpu),  # decode graphs capture them
    ],
)
def test_rank_of_record(kind: str, device: str, tmp_path: Path) -> None:
    out = tmp_path / "rec.json"
    subprocess.run(
        [sys.executable, "-m", "gateway.cli", "bench", "engine", "scenario", kind, "--tiny", "--rank-of", "4",
         "--rounds", "1", "--device", device, "--out", str(out)],
        env=ENV, check=True, cwd=ROOT, timeout=600, capture_output=True,
    )  # fmt: skip
    rec = json.loads(out.read_text())
    geometry = rec["geometry"]
    assert geometry["rank_of"] == 4
    H, L = geometry["hidden_size"], geometry["num_layers"]
    entry = rec["scenarios"][kind]
    concurrency = entry["workload"]["concurrency"]
    for side in entry["sides"].values():
        probe = side["collectives"]
        assert probe["label"].startswith("modelled") and probe["world_size"] == 4
        for key, step in probe["per_decode_step"].items():
            T = int(key[1:])
            ops = step["by_collective"]
            # embedding + per layer attention o_proj and MLP/MoE combine; bf16 [T, H] each
            assert ops["all_reduce"]["calls"] == 1 + 2 * L
            assert ops["all_reduce"]["payload_bytes"] == (1 + 2 * L) * T * H * 2
            # the logits: ⌈V/4⌉ columns per rank gathered, bf16
            assert ops["all_gather"] == {
                "calls": 1,
                "payload_bytes": T * 4 * -(-geometry["vocab_size"] // 4) * 2,
                "sent_bytes": 0.75 * T * 4 * -(-geometry["vocab_size"] // 4) * 2,
                "modelled_s": pytest.approx(ops["all_gather"]["modelled_s"]),
            }
        assert set(probe["per_decode_step"]) == {"c1", f"c{concurrency}"}
        # on CUDA the decode steps replay graphs (the local collectives captured in them)
        assert (
            side["decode_graphs"].startswith("buckets")
            if device == "cuda"
            else side["decode_graphs"] == "off"
        )
    runs = [run for r in entry["rounds"] for run in r["runs"]]
    assert runs and all((run["graph_replays"] > 0) == (device == "cuda") for run in runs)

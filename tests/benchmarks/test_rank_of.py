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
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))

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

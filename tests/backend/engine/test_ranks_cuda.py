"""Two ranks over NCCL, one GPU each: pure-decode steps replayed from CUDA graphs with the collectives
captured in them give the eager steps' greedy tokens (device tool, a host with two GPUs or more;
test_ranks_engine.py checks the same path on the CPU over gloo, with `eager_capture`).

Each rank builds an eager engine and a graphed one over its slice of a random bf16 checkpoint, in
the same order (the graphed one captures its buckets, collectives inside, on both ranks together);
rank 0 serves the same requests on each, and rank 1 follows each engine's steps in turn. Tokens are
compared as in test_decode_graphs_cuda.py (equal up to a near-tie). Run with `-s` for step times.
"""

from __future__ import annotations

import pickle
import statistics
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.ranks import StepChannel, follow_steps
from backend.models.loader import load_model
from backend.tools.random_checkpoint import KINDS, write_random_checkpoint
from tests.backend.engine.test_decode_graphs_cuda import NUM_TOKENS, assert_same_greedy, requests, run_timed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between them)"),
]

BATCHES = (1, 3, 8)  # 3: a padded bucket (4), its padding row through the collectives too


def _engine(loaded: Any, device: torch.device, channel: StepChannel, graphs: bool) -> Engine:
    config = EngineConfig.build(
        num_pages=256,
        page_size=16,
        max_num_seqs=8,  # buckets 1, 2, 4, 8
        max_num_batched_tokens=512,
        context_window=256,
        enable_prefix_cache=False,
        cuda_graphs=graphs,
    )
    return Engine(
        loaded.model,
        config,
        vocab_size=loaded.config.vocab_size,
        context_window=loaded.config.max_position_embeddings,
        model_dtype=torch.bfloat16,
        device=device,
        ranks=channel,
    )


def _rank_main(rank: int, path: str, tmp: str) -> None:
    device = torch.device("cuda", rank)
    torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        loaded = load_model(path, dtype=torch.bfloat16, device=device, rank=rank, world_size=2)
        channel = StepChannel(rank, 2, device)
        engines = {graphs: _engine(loaded, device, channel, graphs) for graphs in (False, True)}
        graphs = engines[True].runner.graphs
        assert engines[False].runner.graphs is None and graphs is not None
        out: dict[str, Any] = {"enabled": graphs.is_enabled, "why": graphs.disabled_reason}
        vocab = loaded.config.vocab_size
        for is_graphed, engine in engines.items():
            if rank == 0:
                for num_seqs in BATCHES:
                    tag = f"{'graph' if is_graphed else 'eager'}{num_seqs}"
                    out[tag] = run_timed(engine, requests(num_seqs, vocab, tag))
                channel.send(None)
            else:
                follow_steps(engine.runner, channel)
        out["replays"] = graphs.num_replays
        (Path(tmp) / f"rank{rank}.pkl").write_bytes(pickle.dumps(out))
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("kind", KINDS)
def test_nccl_decode_graphs_match_eager(kind: str, tmp_path: Path) -> None:
    path = write_random_checkpoint(kind, tmp_path / kind, dtype=torch.bfloat16)
    mp.start_processes(_rank_main, args=(str(path), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [pickle.loads((tmp_path / f"rank{r}.pkl").read_bytes()) for r in (0, 1)]
    assert ranks[0]["enabled"] and ranks[1]["enabled"], (ranks[0]["why"], ranks[1]["why"])
    # every pure-decode step replayed, on both ranks alike
    assert ranks[0]["replays"] == ranks[1]["replays"] >= len(BATCHES) * (NUM_TOKENS - 2)
    rows = []
    for num_seqs in BATCHES:
        (want, eager_s), (got, graph_s) = ranks[0][f"eager{num_seqs}"], ranks[0][f"graph{num_seqs}"]
        agreed = [assert_same_greedy(want[r], got[r], f"{kind} tp=2 B={num_seqs} {r}") for r in want]
        eager_ms, graph_ms = 1e3 * statistics.median(eager_s), 1e3 * statistics.median(graph_s)
        rows.append(f"{kind:10} tp=2 B={num_seqs}: eager {eager_ms:7.2f} ms/step, graphs {graph_ms:7.2f} "
                    f"ms/step; tokens agreed {sum(agreed)}/{NUM_TOKENS * num_seqs}")  # fmt: skip
    print("\n" + "\n".join(rows))

"""Two ranks over NCCL, one GPU each: pure-decode steps replayed from CUDA graphs with the collectives
captured in them give the eager steps' greedy tokens (device tool, a host with two GPUs or more;
test_ranks_engine.py checks the same path on the CPU over gloo, with `eager_capture`).

Each rank builds an eager engine and a graphed one over its slice of a random bf16 checkpoint, in
the same order (the graphed one captures its buckets, collectives inside, on both ranks together);
rank 0 serves the same requests on each, and rank 1 follows each engine's steps in turn. Tokens are
compared as in test_decode_graphs_cuda.py (equal up to a near-tie). Run with `-s` for step times.
"""

from __future__ import annotations

import faulthandler
import gc
import os
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
from tests.backend.engine.test_speculative import OracleDrafts, assert_same_or_tied, prompts
from tests.backend.engine_helpers import request, run_all
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL between them)"),
]

BATCHES = (1, 3, 8)  # 3: a padded bucket (4), its padding row through the collectives too


def _engine(loaded: Any, device: torch.device, channel: StepChannel, graphs: bool, **spec: Any) -> Engine:
    config = EngineConfig.build(
        **spec,
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
        model_dtype=loaded.model.dtype,
        device=device,
        ranks=channel,
    )


def _watchdog() -> None:
    """A rank stuck in a collective dumps every thread's stack and exits (the test then fails with
    where it was, not with pytest's timeout over the parent's wait)."""
    faulthandler.dump_traceback_later(float(os.environ.get("KUMO_RANK_DUMP_S", "240")), exit=True)


def _in_group(work: Any, rank: int, path: str, tmp: str) -> None:
    """Run `work` in a two-rank NCCL group, then leave it. NCCL destroys a communicator only once
    every CUDA graph that captured its collectives is gone (else `destroy_process_group` waits
    forever), so `work`'s engines (and their graphs) are collected first."""
    _watchdog()
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=2, timeout=timedelta(seconds=120)
    )
    try:
        work(rank, path, tmp)
    finally:
        gc.collect()
        torch.cuda.synchronize()
        dist.destroy_process_group()


def _rank_main(rank: int, path: str, tmp: str) -> None:
    _in_group(_decode_graphs_work, rank, path, tmp)


def _decode_graphs_work(rank: int, path: str, tmp: str) -> None:
    device = torch.device("cuda", rank)
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


def _spec_rank_main(rank: int, path: str, tmp: str) -> None:
    _in_group(_spec_work, rank, path, tmp)


def _spec_work(rank: int, path: str, tmp: str) -> None:
    """Plain decoding, then speculative (mtp:3, graphs on) over the same fp32 slices, both TP2."""
    device = torch.device("cuda", rank)
    loaded = load_model(path, dtype=torch.float32, device=device, rank=rank, world_size=2, num_mtp_layers=1)
    channel = StepChannel(rank, 2, device)
    spec = dict(num_speculative_tokens=3, speculative_max_seqs=8, speculative_draft_cost=0.25)
    plain, drafting = (
        _engine(loaded, device, channel, True),
        _engine(loaded, device, channel, True, **spec),
    )
    forwards = drafting.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None and forwards.propose_graphs is not None
    out: dict[str, Any] = {}
    if rank == 0:
        vocab = loaded.config.vocab_size
        reqs = [
            request(f"r{i}", p, max_tokens=12 + 5 * i, logprobs=True, top_logprobs=2)
            for i, p in enumerate(prompts(6, vocab, seed=4))
        ]
        out["plain"] = run_all(plain, reqs)
        channel.send(None)
        OracleDrafts(drafting, out["plain"], p_wrong=0.3)
        out["spec"] = run_all(drafting, reqs)
        channel.send(None)
        # without logprobs: whole greedy steps (backend/engine/speculative/greedy.py), one graph each
        greedy = [
            request(f"gr{i}", p, max_tokens=12 + 5 * i) for i, p in enumerate(prompts(6, vocab, seed=4))
        ]
        assert drafting.spec is not None
        drafting.spec.run = type(drafting.spec).run.__get__(drafting.spec)  # type: ignore[method-assign]
        OracleDrafts(drafting, {f"g{r}": v for r, v in out["plain"].items()}, p_wrong=0.3)
        out["greedy"] = run_all(drafting, greedy)
        channel.send(None)
        out["accepted"] = drafting.stats.spec_accepted_tokens
        out["aborts"] = drafting.stats.tag_check_aborts
    else:
        follow_steps(plain.runner, channel)
        follow_steps(drafting.runner, channel)
        follow_steps(drafting.runner, channel)
    out["replays"] = (
        forwards.graphs.num_replays,
        forwards.propose_graphs.num_replays,
        sum(g.num_replays for g in forwards.draft_graphs),
        forwards.graphs.num_greedy_replays,
    )
    (Path(tmp) / f"spec{rank}.pkl").write_bytes(pickle.dumps(out))


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_nccl_speculative_equals_plain(arch: str, tmp_path: Path) -> None:
    """Speculative decoding across two GPUs: the verify, depth-0, draft-depth and greedy-step graphs
    (collectives inside) replay on both ranks alike, the draft chain runs on each rank's own argmax, and greedy
    outputs are plain TP2 decoding's (near-ties aside, fp32)."""
    path = add_mtp_layers(make_tiny(arch, tmp_path / arch))
    mp.start_processes(_spec_rank_main, args=(str(path), str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [pickle.loads((tmp_path / f"spec{r}.pkl").read_bytes()) for r in (0, 1)]
    assert ranks[0]["replays"] == ranks[1]["replays"] and all(n > 0 for n in ranks[0]["replays"])
    plain, spec = ranks[0]["plain"], ranks[0]["spec"]
    ties = sum(assert_same_or_tied(spec[r], plain[r], r) for r in plain)
    assert ties <= 1 and ranks[0]["accepted"] > 0 and ranks[0]["aborts"] == 0
    greedy = ranks[0]["greedy"]
    ties = sum(greedy[f"g{r}"].token_ids != plain[r].token_ids for r in plain)
    assert ties <= 1  # the same near-ties of fp32 (the host path's comparison above checks them)

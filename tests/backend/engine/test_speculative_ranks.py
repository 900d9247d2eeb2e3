"""Speculative decoding under tensor parallelism: 2 ranks over gloo (forked) give the greedy tokens
and logprobs of one rank, drafts and all.

Rank 0 runs the engine with `--speculative mtp:3`; rank 1 follows every forward of each speculative
step (the verify, then each draft depth: `StepInputs.spec`), on its slice of the model and of the
MTP layer (sharded like a decoder layer: attention heads, routed experts by rank; `eh_proj` and the
norms replicated). Drafts come from the MTP layer (mostly rejected: random weights), or from the
plain run's tokens with some made wrong (`OracleDrafts`, accepted runs of every length).
"""

from __future__ import annotations

import pickle
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
from tests.backend.engine.test_speculative import OracleDrafts
from tests.backend.engine_helpers import Result, prompt_of, request, run_all
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny

VOCAB = 253  # prime: uneven vocab-parallel ranges


def _engine(path: str, rank: int, world: int, k: int, channel: StepChannel | None, dcp: int = 1) -> Engine:
    loaded = load_model(path, dtype=torch.float32, rank=rank, world_size=world, dcp=dcp, num_mtp_layers=1)
    config = EngineConfig.build(
        page_size=4 * dcp,
        num_pages=96,
        max_num_batched_tokens=32,
        max_num_seqs=8,
        num_speculative_tokens=k,
        speculative_adaptive=False,
    )
    return Engine(
        loaded.model,
        config,
        vocab_size=VOCAB,
        context_window=loaded.config.max_position_embeddings,
        ranks=channel,
    )


def _requests(logprobs: bool = True) -> list[Any]:
    """With logprobs the host path; without, longer, mostly whole greedy steps on the device."""
    lengths = (29, 13, 21, 6)
    if not logprobs:
        return [
            request(f"r{i}", prompt_of(i + 1, n, VOCAB), max_tokens=24 + i) for i, n in enumerate(lengths)
        ]
    return [
        request(f"r{i}", prompt_of(i + 1, n, VOCAB), max_tokens=5 + 3 * i, logprobs=True, top_logprobs=2)
        for i, n in enumerate(lengths)
    ]


def _rank_main(
    rank: int, world: int, path: str, dcp: int, plain: dict[str, Result] | None, tmp: str, logprobs: bool
) -> None:
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        channel = StepChannel(rank, world, torch.device("cpu"))
        engine = _engine(path, rank, world, 3, channel, dcp)
        if rank == 0:
            if plain is not None:
                OracleDrafts(engine, plain, p_wrong=0.25)
            outputs = run_all(engine, _requests(logprobs))
            channel.send(None)
            stats = engine.stats
            assert engine.spec is not None
            greedy = engine.spec.num_greedy_steps
            (Path(tmp) / "outputs.pkl").write_bytes(
                pickle.dumps(
                    (outputs, engine.load(), stats.spec_drafted_tokens, stats.spec_accepted_tokens, greedy)
                )
            )
        else:
            assert follow_steps(engine.runner, channel) > 3
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("dcp", "oracle", "logprobs"),
    [(1, False, True), (1, True, True), (2, True, True), (1, True, False), (2, True, False)],
)
def test_two_ranks_speculate_what_one_decodes(tmp_path: Path, dcp: int, oracle: bool, logprobs: bool) -> None:
    """Without logprobs the steps are whole greedy ones (backend/engine/speculative/greedy.py): the
    ranks run the same function (from its graph or not) and OR their tag flags."""
    path = add_mtp_layers(make_tiny("deepseek_v3", tmp_path / "ckpt", vocab_size=VOCAB))
    plain = run_all(_engine(str(path), 0, 1, 0, None), _requests(logprobs))
    one_rank = _engine(str(path), 0, 1, 3, None)
    if oracle:
        OracleDrafts(one_rank, plain, p_wrong=0.25)
    want = run_all(one_rank, _requests(logprobs))
    mp.start_processes(
        _rank_main,
        args=(2, str(path), dcp, plain if oracle else None, str(tmp_path), logprobs),
        nprocs=2,
        start_method="fork",
    )
    got, load, drafted, accepted, greedy = pickle.loads((tmp_path / "outputs.pkl").read_bytes())
    assert (greedy > 0) == (not logprobs)
    assert got.keys() == want.keys() == plain.keys()
    for rid, w in want.items():
        g = got[rid]
        assert g.error is None and g.token_ids == w.token_ids == plain[rid].token_ids, rid
        torch.testing.assert_close(
            [lp.logprob for lp in g.logprobs], [lp.logprob for lp in w.logprobs], atol=1e-5, rtol=0
        )
    assert drafted > 0
    if oracle:
        assert accepted > drafted / 3  # accepted runs of every length went through both ranks
    assert load.free_pages == load.total_pages and load.running == load.waiting == 0

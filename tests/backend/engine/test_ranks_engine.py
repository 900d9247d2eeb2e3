"""The rank group's step loop at the engine level: 2 ranks over gloo (forked) give the 1-rank engine's
greedy tokens and logprobs for every architecture (Kimi K2.5 with an image), and a tag fault on
rank 1 alone aborts exactly the request it hit, on every rank, with the others unharmed. With decode
graphs (`eager_capture`, the CPU's seam into them) every rank replays the same buckets, padding rows
included, and serves the same; a capture that fails on one rank leaves every rank eager.

Rank 0 runs the `Engine` (scheduler, block manager, sampler) with a `StepChannel`; rank 1 builds the
same engine over its slice of the checkpoint and follows rank 0's steps (`follow_steps`).
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from backend.engine.decode_graphs import Capture, Replay, eager_capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.ranks import StepChannel, StepInputs, follow_steps
from backend.models.loader import load_model
from schemas.backend import EngineOutput, ImageSpan
from tests.backend.engine_helpers import prompt_of, request
from tests.backend.models.test_models_parallel import _image_step
from tests.backend.tiny_checkpoints import make_tiny

VOCAB = 253  # prime: uneven vocab-parallel ranges
BUCKETS = (1, 2, 4, 8)  # the decode graphs' batch sizes (the tests with graphs)
IMAGE_ROWS = [4, 5, 6, 7]  # the K2.5 request's image placeholders (a 56×56 image: 4 tokens)


def _engine(
    path: str, rank: int, world: int, dcp: int, channel: StepChannel | None, capture: Capture | None = None
) -> Engine:
    loaded = load_model(path, dtype=torch.float32, rank=rank, world_size=world, dcp=dcp)
    config = EngineConfig.build(
        page_size=4 * dcp,
        num_pages=48,
        max_num_batched_tokens=24,
        max_num_seqs=8,
        cuda_graph_batch_sizes=BUCKETS,
    )
    return Engine(
        loaded.model,
        config,
        vocab_size=VOCAB,
        context_window=loaded.config.max_position_embeddings,
        graph_capture=capture,
        ranks=channel,
    )


class CountingCapture:
    """`eager_capture` that counts each bucket's replays; with `is_failing`, every capture raises
    (as a host sync on the decode path would under CUDA)."""

    def __init__(self, is_failing: bool = False) -> None:
        self.is_failing = is_failing
        self.counts: list[int] = []  # per capture, in capture order (largest bucket first)

    def __call__(self, step: Callable[[], torch.Tensor]) -> Replay:
        if self.is_failing:
            raise RuntimeError("a host sync on the decode path")
        i = len(self.counts)
        self.counts.append(0)

        def replay() -> torch.Tensor:
            self.counts[i] += 1
            return eager_capture(step)()

        return replay

    def by_bucket(self, num_widths: int = 1) -> dict[int, int]:
        """Replays per bucket, over its `num_widths` captures (one per page-table width, in a row)."""
        per_bucket = [sum(self.counts[i : i + num_widths]) for i in range(0, len(self.counts), num_widths)]
        return dict(zip(sorted(BUCKETS, reverse=True), per_bucket, strict=False))


def _serve(engine: Engine, path: str, arch: str) -> dict[str, list[EngineOutput]]:
    """Three greedy requests with logprobs (one with prompt logprobs, K2.5's with an image), stepped
    to the end with chunked prefill; every output by request."""
    prompts = [prompt_of(1, 29, VOCAB), prompt_of(2, 13, VOCAB), prompt_of(3, 21, VOCAB)]
    for i, prompt in enumerate(prompts):
        req = request(f"r{i}", prompt, max_tokens=6, logprobs=True, top_logprobs=2, prompt_logprobs=i == 1)
        embeds = None
        if arch == "kimi_k25" and i == 0:
            req.image_spans = [ImageSpan(offset=IMAGE_ROWS[0], length=len(IMAGE_ROWS), image_hash="ab" * 32)]
            embeds = _image_step(Path(path), prompt, IMAGE_ROWS).embeds
        engine.add_request(req, image_embeds=embeds)
    out: dict[str, list[EngineOutput]] = {}
    while engine.has_unfinished:
        for o in engine.step():
            out.setdefault(o.request_id, []).append(o)
    return out


class _FaultOnFirstDecode:
    """Rank 1's runner, with one stale page on that rank only: before the first pure-decode step, the
    first page of the step's first sequence gets a tag the block manager never gave it."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.is_done = runner, False

    def forward_step(self, inputs: StepInputs) -> Any:
        if not self.is_done and inputs.host.is_pure_decode:
            self.is_done = True
            page = int(inputs.host.page_table[0, 0])
            self.runner.kv_cache.page_tags[page] += 1_000_003
        return self.runner.forward_step(inputs)


def _rank_main(
    rank: int, world: int, arch: str, path: str, dcp: int, fault: bool, graphs: str, tmp: str
) -> None:
    """`graphs`: "" (no decode graphs), "eager" (`CountingCapture` on every rank), "fail1" (rank 1's
    captures fail). With graphs each rank writes what its graphs did to graphs-{rank}.pkl."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp}/rdzv", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    try:
        channel = StepChannel(rank, world, torch.device("cpu"))
        capture = CountingCapture(is_failing=graphs == "fail1" and rank == 1) if graphs else None
        engine = _engine(path, rank, world, dcp, channel, capture)
        if rank == 0:
            outputs = _serve(engine, path, arch)
            again = _serve(engine, path, arch) if fault else None  # the same requests, after the fault
            channel.send(None)
            (Path(tmp) / "outputs.pkl").write_bytes(pickle.dumps((outputs, engine.load(), again)))
        else:
            runner = _FaultOnFirstDecode(engine.runner) if fault else engine.runner
            num_steps = follow_steps(runner, channel)
            assert num_steps > 3
        if capture is not None:
            g = engine.runner.graphs
            assert g is not None
            state = (g.is_enabled, g.num_replays, capture.by_bucket(len(g.widths)), g.disabled_reason)
            (Path(tmp) / f"graphs-{rank}.pkl").write_bytes(pickle.dumps(state))
    finally:
        dist.destroy_process_group()


def _run_ranks(
    arch: str, path: Path, tmp: Path, *, dcp: int = 1, fault: bool = False, graphs: str = ""
) -> Any:
    """Rank 0's outputs by request, its load after them, and (with `fault`) the outputs of the same
    requests asked again after the fault."""
    mp.start_processes(
        _rank_main, args=(2, arch, str(path), dcp, fault, graphs, str(tmp)), nprocs=2, start_method="fork"
    )
    return pickle.loads((tmp / "outputs.pkl").read_bytes())


def _graphs_of(tmp: Path, rank: int) -> tuple[bool, int, dict[int, int], str | None]:
    return pickle.loads((tmp / f"graphs-{rank}.pkl").read_bytes())


def _tokens_and_logprobs(outputs: list[EngineOutput]) -> tuple[list[int], list[float], list[Any]]:
    tokens = [t for o in outputs for t in o.token_ids]
    logprobs = [lp.logprob for o in outputs for lp in (o.logprobs or [])]
    prompt = [p.logprob if p else None for o in outputs for p in (o.prompt_logprobs or [])]
    return tokens, logprobs, prompt


CASES = [
    ("deepseek_v3", 1),
    ("deepseek_v3", 2),
    ("glm_moe_dsa", 1),
    ("glm_moe_dsa", 2),
    ("glm4_moe", 1),
    ("kimi_k25", 1),
]


def _assert_same_outputs(got: dict[str, list[EngineOutput]], expected: dict[str, list[EngineOutput]]) -> None:
    assert got.keys() == expected.keys() == {"r0", "r1", "r2"}
    for rid in expected:
        e_tokens, e_logprobs, e_prompt = _tokens_and_logprobs(expected[rid])
        g_tokens, g_logprobs, g_prompt = _tokens_and_logprobs(got[rid])
        assert g_tokens == e_tokens and len(e_tokens) == 6, rid
        assert got[rid][-1].finish_reason == "length"
        torch.testing.assert_close(torch.tensor(g_logprobs), torch.tensor(e_logprobs), atol=1e-5, rtol=0)
        assert [p is None for p in g_prompt] == [p is None for p in e_prompt]
        torch.testing.assert_close(
            torch.tensor([p or 0.0 for p in g_prompt]),
            torch.tensor([p or 0.0 for p in e_prompt]),
            atol=1e-5,
            rtol=0,
        )


@pytest.mark.parametrize(("arch", "dcp"), CASES)
def test_two_ranks_serve_what_one_serves(arch: str, dcp: int, tmp_path: Path) -> None:
    path = make_tiny(arch, tmp_path / "ckpt", vocab_size=VOCAB)
    expected = _serve(_engine(str(path), 0, 1, 1, None), str(path), arch)
    got, load, _ = _run_ranks(arch, path, tmp_path, dcp=dcp)
    _assert_same_outputs(got, expected)
    assert load.free_pages == load.total_pages and load.running == load.waiting == 0


@pytest.mark.parametrize(("arch", "dcp"), [("deepseek_v3", 1), ("glm_moe_dsa", 2), ("glm4_moe", 1)])
def test_two_ranks_replay_the_same_decode_graphs(arch: str, dcp: int, tmp_path: Path) -> None:
    # every rank's pure-decode steps go through DecodeGraphs (static buffers, padding rows, the
    # collectives inside the captured step) in the same buckets, and serve what one eager rank serves
    path = make_tiny(arch, tmp_path / "ckpt", vocab_size=VOCAB)
    expected = _serve(_engine(str(path), 0, 1, 1, None), str(path), arch)
    got, load, _ = _run_ranks(arch, path, tmp_path, dcp=dcp, graphs="eager")
    _assert_same_outputs(got, expected)
    assert load.free_pages == load.total_pages
    on0, replays0, buckets0, _ = _graphs_of(tmp_path, 0)
    on1, replays1, buckets1, _ = _graphs_of(tmp_path, 1)
    assert on0 and on1
    assert replays0 == replays1 == sum(buckets0.values()) >= 5
    assert buckets0 == buckets1
    assert buckets0[4] > 0  # three sequences decode in bucket 4: one padding row, through the collectives


def test_a_capture_failed_on_one_rank_leaves_every_rank_eager(tmp_path: Path) -> None:
    path = make_tiny("deepseek_v3", tmp_path / "ckpt", vocab_size=VOCAB)
    expected = _serve(_engine(str(path), 0, 1, 1, None), str(path), "deepseek_v3")
    got, _, _ = _run_ranks("deepseek_v3", path, tmp_path, graphs="fail1")
    _assert_same_outputs(got, expected)
    (on0, replays0, buckets0, why0), (on1, _, _, why1) = _graphs_of(tmp_path, 0), _graphs_of(tmp_path, 1)
    assert not on0 and not on1 and replays0 == 0 == sum(buckets0.values())
    assert why0 is not None and "another rank" in why0
    assert why1 is not None and "host sync" in why1


@pytest.mark.parametrize("graphs", ["", "eager"])
def test_tag_fault_on_rank_1_aborts_only_its_request(graphs: str, tmp_path: Path) -> None:
    path = make_tiny("deepseek_v3", tmp_path / "ckpt", vocab_size=VOCAB)
    expected = _serve(_engine(str(path), 0, 1, 1, None), str(path), "deepseek_v3")
    got, load, again = _run_ranks("deepseek_v3", path, tmp_path, fault=True, graphs=graphs)
    aborted = {rid for rid, outs in got.items() if outs[-1].error is not None}
    assert len(aborted) == 1, got
    (victim,) = aborted
    error = got[victim][-1].error
    assert error.code == "integrity_abort" and got[victim][-1].finish_reason == "abort"
    assert "on another rank" in error.message  # rank 0's own pages were sound
    # its tokens before the fault are the reference's; it got none from the faulty step on
    tokens = _tokens_and_logprobs(got[victim])[0]
    assert tokens == _tokens_and_logprobs(expected[victim])[0][: len(tokens)] and len(tokens) < 6
    for rid in expected.keys() - aborted:
        g_tokens, g_logprobs, _ = _tokens_and_logprobs(got[rid])
        e_tokens, e_logprobs, _ = _tokens_and_logprobs(expected[rid])
        assert g_tokens == e_tokens and got[rid][-1].finish_reason == "length"
        torch.testing.assert_close(torch.tensor(g_logprobs), torch.tensor(e_logprobs), atol=1e-5, rtol=0)
    assert load.free_pages == load.total_pages  # the victim's pages went back to the pool
    if graphs:  # the faulty step was a replay on both ranks
        assert _graphs_of(tmp_path, 0)[1] == _graphs_of(tmp_path, 1)[1] > 0
    # asked again (the same prompts and salt): the victim's pages were taken out of the prefix
    # cache, so no request is given the stale page again, and every answer is the reference's
    for rid in expected:
        g_tokens, g_logprobs, _ = _tokens_and_logprobs(again[rid])
        e_tokens, e_logprobs, _ = _tokens_and_logprobs(expected[rid])
        assert g_tokens == e_tokens and again[rid][-1].finish_reason == "length", rid
        torch.testing.assert_close(torch.tensor(g_logprobs), torch.tensor(e_logprobs), atol=1e-5, rtol=0)


def test_parallel_settings() -> None:
    from backend.server.settings import build_settings

    base = ["--model", "m", "--port", "1", "--secret", "s" * 8]
    s = build_settings([*base, "--tp", "8", "--ep", "4", "--dcp", "8", "--rank-timeout-s", "30"])
    assert (s.tp, s.ep, s.dcp, s.rank_timeout_s) == (8, 4, 8, 30.0)
    assert (build_settings(base).tp, build_settings(base).ep, build_settings(base).dcp) == (1, 0, 1)
    for bad in (["--tp", "4", "--dcp", "3"], ["--tp", "4", "--ep", "3"], ["--tp", "0"]):
        with pytest.raises(SystemExit):
            build_settings([*base, *bad])

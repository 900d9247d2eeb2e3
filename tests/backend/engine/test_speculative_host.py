"""The host's transfers in a greedy speculative step at one sequence (backend/engine/speculative/decoder.py
`_run_greedy`), against a plain decode step's. On the GPU every copy to the device and every read back
costs tens of microseconds and a read waits for the device, so a greedy step, like a plain one, sends
its inputs (the page-tag updates with them) in one copy, makes no tensor from host data besides, and
reads back one tensor. Counted on the CPU over the graphs' buffers (`eager_capture`), where each step
takes the path it takes on the GPU."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import backend.engine.host_staging as host_staging
from backend.engine import decode_graphs, model_runner
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.speculative import accept, decoder, forwards, verify_graphs
from backend.models.loader import prepare_model
from tests.backend.engine.test_speculative import ARCHS, engine_for, loaded, prompts
from tests.backend.engine.test_speculative_greedy import graphed
from tests.backend.engine_helpers import Result, collect, request, run_all, spy_tag_updates

__all__ = ["loaded"]  # the fixture

# the engine modules that copy host values to the device (`to_device`, `array_to_device`)
COPIERS = (decode_graphs, model_runner, decoder, accept, forwards, verify_graphs)


class Transfers:
    """Counts, while installed and outside `model`'s forwards (an eager forward's own work is the
    model's, as a graph's is): copies to the device (`h2d`: a staging buffer's send, the
    `to_device` helpers, `torch.tensor(..., device=)`), tensors made from host data (`host_tensors`)
    and reads of device values (`reads`)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, model: Any) -> None:
        self.counts: Counter[str] = Counter()
        self.inside = 0

        def counted(fn: Callable[..., Any], label: str) -> Callable[..., Any]:
            def wrapper(*args: Any, **kw: Any) -> Any:
                if not self.inside:
                    self.counts[label] += 1
                    if label == "host_tensors" and kw.get("device") is not None:
                        self.counts["h2d"] += 1
                return fn(*args, **kw)

            return wrapper

        def forward(fn: Callable[..., Any]) -> Callable[..., Any]:
            def wrapper(*args: Any, **kw: Any) -> Any:
                self.inside += 1
                try:
                    return fn(*args, **kw)
                finally:
                    self.inside -= 1

            return wrapper

        monkeypatch.setattr(
            host_staging.StagingBuffer, "send", counted(host_staging.StagingBuffer.send, "h2d")
        )
        for module in COPIERS:
            for name in ("to_device", "array_to_device"):
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, counted(getattr(module, name), "h2d"))
        for name in ("tensor", "as_tensor", "from_numpy"):
            monkeypatch.setattr(torch, name, counted(getattr(torch, name), "host_tensors"))
        for name in ("tolist", "item", "cpu"):
            monkeypatch.setattr(torch.Tensor, name, counted(getattr(torch.Tensor, name), "reads"))
        for name in ("forward", "forward_spec", "forward_mtp"):
            monkeypatch.setattr(model, name, forward(getattr(model, name)))


def steps(
    engine: Any, reqs: list[Any], transfers: Transfers
) -> tuple[list[dict[str, int]], dict[str, Result]]:
    """Run `reqs` to the end: each step's counts with whether it was a greedy step, a decode step
    (one token per sequence) and whether it carried page-tag updates."""
    had_updates = spy_tag_updates(engine)
    for r in reqs:
        engine.add_request(r)
    out: list[dict[str, int]] = []
    results: dict[str, Result] = {}
    while engine.has_unfinished:
        greedy = engine.spec.num_greedy_steps if engine.spec is not None else 0
        computed, running = engine.stats.computed_tokens, len(engine.scheduler.running)
        transfers.counts.clear()
        collect(results, engine.step())
        record = dict(transfers.counts)
        record["greedy"] = int(engine.spec is not None and engine.spec.num_greedy_steps > greedy)
        record["decode"] = int(running > 0 and engine.stats.computed_tokens - computed == running)
        record["tag_updates"] = int(had_updates[0])
        out.append(record)
    return out, results


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kind", ["greedy", "greedy-eager", "plain"])
def test_a_decode_step_sends_once_and_reads_once(
    loaded: dict[str, Any], arch: str, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every greedy step with k = 3 drafts, from the graphs' buffers or eager (no graphs: the CPU's
    path), and, the bar they are held to, every plain decode step: one copy to the device, the
    page-tag updates in it too, one read back, no tensor from host data; greedy outputs those of
    plain decoding."""
    model = loaded[arch]
    reqs = [request("r0", prompts(1, model.config.vocab_size, seed=4)[0], max_tokens=40)]
    plain = run_all(engine_for(model, 0), reqs)
    k = 0 if kind == "plain" else 3
    engine = engine_for(model, k, speculative_adaptive=False) if kind == "greedy-eager" else graphed(model, k)
    records, results = steps(engine, reqs, Transfers(monkeypatch, engine.runner.model))
    assert results["r0"].token_ids == plain["r0"].token_ids
    kept = [r for r in records if (r["greedy"] if k else r["decode"])]
    assert len(kept) >= 5 and any(r["tag_updates"] for r in kept)  # some steps carried new pages' tags
    forwards = engine.runner.spec_forwards
    if kind == "greedy":
        assert forwards is not None and forwards.graphs is not None
        assert forwards.graphs.num_greedy_replays == len(kept)
    if kind == "greedy-eager":
        assert forwards is not None and forwards.graphs is None
    for r in kept:
        assert (r.get("h2d", 0), r.get("reads", 0), r.get("host_tensors", 0)) == (1, 1, 0), r


@pytest.mark.parametrize("arch", ARCHS)
def test_a_drafting_request_reserves_each_page_once(
    loaded: dict[str, Any], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Greedy steps at k = 3 over four requests: a request that keeps drafting keeps its draft pages
    from step to step, under their tags, so each page of a request's window (prompt + max_tokens) is
    reserved once, and a greedy step carries tag updates only where some request reaches a page it
    did not hold. (Given back after each step and reserved again, as before 2026-12-05: 156
    reservations for deepseek_v3's 41 window pages, and 46 of its 53 greedy steps carried tags.)"""
    model = loaded[arch]
    ps = prompts(4, model.config.vocab_size, seed=4)
    reqs = [request(f"r{i}", p, max_tokens=60) for i, p in enumerate(ps)]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3, speculative_adaptive=False)
    bm = engine.block_manager
    records, results = steps(engine, reqs, Transfers(monkeypatch, engine.runner.model))
    assert {rid: r.token_ids for rid, r in results.items()} == {rid: r.token_ids for rid, r in plain.items()}
    assert all(len(r.token_ids) == 60 for r in results.values())  # every window filled
    window_pages = sum(bm.num_pages_for(len(p) + 60) for p in ps)
    prompt_pages = sum(bm.num_pages_for(len(p)) for p in ps)
    assert bm.stats.num_allocations == window_pages  # no page reserved twice
    greedy = [r for r in records if r["greedy"]]
    assert len(greedy) >= 30
    assert 0 < sum(r["tag_updates"] for r in greedy) <= window_pages - prompt_pages
    assert not bm.spare_holders and bm.num_available_pages == bm.num_pages


# views, allocations and metadata: no launch on the device
NO_LAUNCH = {
    "view", "_unsafe_view", "slice", "select", "alias", "as_strided", "unsqueeze", "squeeze", "expand",
    "t", "transpose", "permute", "detach", "unbind", "split", "split_with_sizes", "narrow", "resolve_conj",
    "resolve_neg", "empty", "empty_strided", "lift_fresh", "_reshape_alias", "reshape",
}  # fmt: skip
# what a greedy step may launch outside its graph: the static buffers' fills from the staged copy, and
# on a step that reserves pages their tags and their MTP KV's clearing
BUFFER_FILLS = {"copy_", "fill_", "index_copy_", "index_fill_"}


class OutsideReplays(TorchDispatchMode):
    """The aten ops that launch (by name) dispatched outside a replay, and the replays and rotary
    cos/sin computations inside them; `capture` is the engine's (`eager_capture`, marked)."""

    def __init__(self) -> None:
        super().__init__()
        self.inside = 0
        self.ops: Counter[str] = Counter()
        self.replays = self.cos_sin = 0

    def capture(self, step: Callable[[], Any]) -> Callable[[], Any]:
        def replay() -> Any:
            self.replays += 1
            self.inside += 1
            try:
                return step()
            finally:
                self.inside -= 1

        return replay

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = str(func.overloadpacket.__name__)
        if not self.inside and name not in NO_LAUNCH:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3])
def test_a_greedy_step_launches_only_buffer_fills_outside_its_graph(
    loaded: dict[str, Any], arch: str, k: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A whole greedy step with fixed k, over the graphs' buffers: one replay, and outside it only
    the copies that fill the static buffers from the one staged copy (and a new page's tag and MTP
    KV clearing): no eager forward, no eager op of the step's own. Inside it, the verify and depth 0
    share one `Step` (their rows are the same) and the chained depths get theirs at once: the rotary
    cos/sin are computed once for k = 1 and twice otherwise (each forward computed its own until
    2026-12-05: k + 1 times)."""
    from backend.models.layers.rotary import Rotary

    model = loaded[arch]
    reqs = [request("r0", prompts(1, model.config.vocab_size, seed=4)[0], max_tokens=40)]
    plain = run_all(engine_for(model, 0), reqs)
    counter = OutsideReplays()
    c = EngineConfig.build(
        num_pages=96, page_size=8, max_num_batched_tokens=64, max_num_seqs=16, num_speculative_tokens=k,
        speculative_max_seqs=16, speculative_adaptive=False, cuda_graph_batch_sizes=(1, 2, 4, 8, 16),
    )  # fmt: skip
    engine = Engine.from_prepared(prepare_model(model, c), c, graph_capture=counter.capture)
    cos_sin = Rotary.cos_sin

    def counted_cos_sin(self: Rotary, *args: Any) -> Any:
        counter.cos_sin += counter.inside > 0
        return cos_sin(self, *args)

    monkeypatch.setattr(Rotary, "cos_sin", counted_cos_sin)
    transfers = Transfers(monkeypatch, engine.runner.model)
    assert engine.spec is not None
    results: dict[str, Result] = {}
    engine.add_request(reqs[0])
    kept = []
    with counter:
        while engine.has_unfinished:
            greedy = engine.spec.num_greedy_steps
            counter.ops.clear()
            transfers.counts.clear()
            counter.replays = counter.cos_sin = 0
            collect(results, engine.step())
            if engine.spec.num_greedy_steps > greedy:
                kept.append((dict(counter.ops), counter.replays, counter.cos_sin, dict(transfers.counts)))
    assert results["r0"].token_ids == plain["r0"].token_ids
    assert len(kept) >= 5
    for ops, replays, cos_sin_calls, counts in kept:
        assert replays == 1 and cos_sin_calls == min(k, 2), (replays, cos_sin_calls)
        assert set(ops) <= BUFFER_FILLS and ops.get("copy_", 0) <= 5, ops  # vectors, table, tags, guards
        assert (counts.get("h2d", 0), counts.get("reads", 0)) == (1, 1), counts

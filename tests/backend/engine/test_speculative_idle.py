"""Speculation on but drafting nothing costs nothing (issue 28: "no loss at c=64, the scheduler turns
it down"). Past `max_drafting_seqs` running sequences the draft policy is not asked and every step is a
plain one (backend/engine/speculative/decoder.py `drafting`); such a step must launch exactly what a step
with speculation off launches: the same torch ops, the same copies to the device and reads back. On
the GPU each op outside the decode graph is a launch and host time on the step's critical path
(lab/results/2026-12-05-c64-idle: before, every step that allocated pages also zeroed the MTP layer's
cache slots of those pages, one more launch per cache tensor).

Counted on the CPU over the decode graphs' buffers (`eager_capture`: the GPU's path, no graph)."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from torch.utils._python_dispatch import TorchDispatchMode

from backend.engine.engine import Engine
from tests.backend.engine.test_speculative import ARCHS, loaded, prompts
from tests.backend.engine.test_speculative_greedy import graphed
from tests.backend.engine.test_speculative_host import Transfers
from tests.backend.engine_helpers import Result, collect, request, spy_tag_updates

__all__ = ["loaded"]  # the fixture

NUM_SEQS = 64


class Ops(TorchDispatchMode):
    """Every torch op dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def step_by_step(
    engine: Engine, reqs: list[Any], transfers: Transfers
) -> tuple[list[dict[str, Any]], dict[str, Result]]:
    """Run `reqs` to the end: per step its ops, its transfers, how many ran and whether it drafted."""
    had_updates = spy_tag_updates(engine)
    for r in reqs:
        engine.add_request(r)
    records: list[dict[str, Any]] = []
    results: dict[str, Result] = {}
    while engine.has_unfinished:
        ops = Ops()
        transfers.counts.clear()
        with ops:
            outputs = engine.step()
        collect(results, outputs)
        records.append(
            {
                "ops": dict(ops.counts),
                "transfers": dict(transfers.counts),
                "running": len(engine.scheduler.running) + sum(o.finish_reason is not None for o in outputs),
                "drafting": engine.spec is not None and engine.spec.k > 0,
                "tag_updates": had_updates[0],
            }
        )
    return records, results


@pytest.mark.parametrize("arch", ARCHS)
def test_a_step_that_drafts_nothing_is_a_plain_step(
    loaded: dict[str, Any], arch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """64 sequences, every step past `max_drafting_seqs` (mtp:3, the adaptive policy as served):
    each step runs the same torch ops, by name and count, with the same copies to the device and
    reads back, as the same step with speculation off; greedy outputs identical."""
    model = loaded[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=12, ignore_eos=True)
        for i, p in enumerate(prompts(NUM_SEQS, model.config.vocab_size, seed=11))
    ]
    config = dict(
        num_pages=640, max_num_batched_tokens=4096, max_num_seqs=NUM_SEQS, speculative_max_seqs=NUM_SEQS,
        cuda_graph_batch_sizes=(1, 8, 16, 32, NUM_SEQS),
    )  # fmt: skip
    sides = {}
    for side, k in (("on", 3), ("off", 0)):
        engine = graphed(model, k, **config)
        with monkeypatch.context() as m:
            sides[side] = step_by_step(engine, reqs, Transfers(m, engine.runner.model))
        if k:
            assert engine.spec is not None and engine.spec.max_drafting_seqs < NUM_SEQS
            assert engine.stats.spec_drafted_tokens == 0
    (on, on_results), (off, off_results) = sides["on"], sides["off"]
    assert {r: v.token_ids for r, v in on_results.items()} == {r: v.token_ids for r, v in off_results.items()}
    assert len(on) == len(off) and all(r["running"] == NUM_SEQS for r in on)
    assert not any(r["drafting"] for r in on)
    assert sum(r["tag_updates"] for r in on) >= 2  # steps that allocated pages: the prompt's, then decode's
    for step, (a, b) in enumerate(zip(on, off, strict=True)):
        assert a["tag_updates"] == b["tag_updates"]
        assert a["transfers"] == b["transfers"], step
        extra = Counter(a["ops"])
        extra.subtract(b["ops"])
        assert a["ops"] == b["ops"], (step, {name: n for name, n in extra.items() if n})


@pytest.mark.parametrize("arch", ARCHS)
def test_a_plain_steps_policy_work_runs_beside_the_device(loaded: dict[str, Any], arch: str) -> None:
    """One sequence, the adaptive policy choosing no drafts: after the first decode step the policy
    is asked once a step, for the next step, while the plain step runs on the device (between its
    launch and its read back: `SpecDecoder.while_plain_step`), and told each step's measurement
    there too; a load that changes (a second request) is chosen for anew. When a choice made ahead
    drafts, the next step drafts. Greedy outputs as with speculation off (issue 28: a c = 1 plain
    step's host time, lab/diagnostics/plain_step_host.py)."""
    model = loaded[arch]
    engine = graphed(model, 3)
    spec = engine.spec
    assert spec is not None and spec.policy.is_adaptive
    beside = [False]
    calls: list[tuple[str, bool]] = []  # (what, whether beside the device)
    plain_step = spec.while_plain_step

    def while_plain_step() -> None:
        beside[0] = True
        try:
            plain_step()
        finally:
            beside[0] = False

    num_chosen = [0]

    def choose(load: Any, request_ids: tuple[str, ...] = (), is_starting: bool = True) -> int:
        calls.append(("choose", beside[0]))
        num_chosen[0] += 1
        return 1 if num_chosen[0] == 14 else 0  # the 14th choice drafts

    observe_step = spec.policy.observe_step

    def observed(*args: Any) -> None:
        calls.append(("observe", beside[0]))
        observe_step(*args)

    spec.while_plain_step = while_plain_step  # type: ignore[method-assign]
    spec.policy.choose = choose  # type: ignore[method-assign]
    spec.policy.observe_step = observed  # type: ignore[method-assign]
    steps: list[tuple[list[tuple[str, bool]], int]] = []  # per step: its calls, the draft length it ran

    def drive(engine: Engine) -> dict[str, Result]:
        """a alone, b joining at the 7th step."""
        first, second = prompts(2, model.config.vocab_size, seed=5)
        engine.add_request(request("a", first, max_tokens=20, ignore_eos=True))
        results: dict[str, Result] = {}
        num_steps = 0
        while engine.has_unfinished:
            calls.clear()
            collect(results, engine.step())
            steps.append((list(calls), engine.spec.k if engine.spec is not None else 0))
            num_steps += 1
            if num_steps == 6:
                engine.add_request(request("b", second, max_tokens=4, ignore_eos=True))
        return results

    got = drive(engine)
    assert steps[0][0] == [("choose", False)]  # the prompt's step (not measured, nothing chosen ahead)
    assert steps[1][0] == [("choose", False), ("choose", True)]  # the first decode step, then ahead
    for at in (2, 3, 4, 5):
        assert steps[at] == ([("observe", True), ("choose", True)], 0), at
    assert steps[6][0] == [("observe", False), ("choose", False)]  # b's prompt joins: a new load
    choices = [
        (at, is_beside) for at, (c, _) in enumerate(steps) for what, is_beside in c if what == "choose"
    ]
    at, is_beside = choices[13]
    assert is_beside and 6 < at < len(steps) - 2  # the 14th choice was made ahead, a's alone again
    assert [n for n, (_, k) in enumerate(steps) if k] == [at + 1]  # and the next step drafted
    assert steps[at + 1][0] == [("observe", False)]  # a drafting step: told at once, nothing ahead
    assert steps[at + 2][0][0] == ("choose", False)  # after it the policy chooses before the step
    want = drive(graphed(model, 0))
    assert {r: v.token_ids for r, v in got.items()} == {r: v.token_ids for r, v in want.items()}

"""Speculation on but drafting nothing costs nothing (issue 28: "no loss at c=64, the scheduler turns
it down"). Past `max_drafting_seqs` running sequences the draft policy is not asked and every step is a
plain one (backend/engine/speculative/decoder.py `drafting`); such a step must launch exactly what a step
with speculation off launches: the same torch ops, the same copies to the device and reads back. On
the GPU each op outside the decode graph is a launch and host time on the step's critical path
(lab/results/2026-12-05-c64-idle: before, every step that allocated pages also zeroed the MTP layer's
cache slots of those pages, one more launch per cache tensor). Below it, at a load where drafting is
priced to lose, the speculative work of a step of decodes is the policy's alone: no pass over the
sequences (lab/diagnostics/spec_plain_host.py), and the same decisions as with one.

Counted on the CPU over the decode graphs' buffers (`eager_capture`: the GPU's path, no graph)."""

from __future__ import annotations

import itertools
from collections import Counter
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput
from backend.engine.speculative.book import DraftBook
from backend.engine.speculative.decoder import PLAIN_REASK
from backend.engine.speculative.load_rates import MIN_RATE_SAMPLES, LoadRates
from tests.backend.engine.test_draft_policy import toy
from tests.backend.engine.test_engine import EvenTokensOnly
from tests.backend.engine.test_speculative import ARCHS, loaded, prompts
from tests.backend.engine.test_speculative_greedy import graphed
from tests.backend.engine.test_speculative_host import Transfers
from tests.backend.engine_helpers import Result, collect, request, run_all, spy_tag_updates
from tests.backend.speculative_toy import MarkovModel

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
    is asked once every `PLAIN_REASK` steps, for the steps ahead, while a plain step runs on the
    device (between its launch and its read back: `SpecDecoder.while_plain_step`), and told the
    measurements of every step since then, in their order; the steps between ask and tell nothing.
    A load that changes (a second request) is chosen for anew at once, told what was measured
    first. When a choice made ahead drafts, the next step drafts. Greedy outputs as with speculation
    off (issue 28: a c = 1 plain step's host time, lab/diagnostics/spec_plain_gpu.py)."""
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

    now = [0]  # the step running
    drafts_at: list[int] = []  # the step whose choice (made ahead) drafted

    def choose(
        load: Any, request_ids: tuple[str, ...] = (), is_starting: bool = True, num_steps: int = 1
    ) -> int:
        calls.append(("choose", beside[0]))
        if beside[0] and now[0] >= 14 and not drafts_at:  # a's alone again: the first choice ahead drafts
            drafts_at.append(now[0])
            return 1
        return 0

    observe_step = spec.policy.observe_step
    told: list[float] = []  # the seconds told, in the order told

    def observed(*args: Any) -> None:
        calls.append(("observe", beside[0]))
        told.append(args[4])
        observe_step(*args)

    observe_plain = spec.policy.observe_plain

    def observed_plain(num_seqs: int, plain: list[tuple[int, float]]) -> None:
        for _, seconds in plain:  # a run of plain steps told at once: each one as told alone
            calls.append(("observe", beside[0]))
            told.append(seconds)
        observe_plain(num_seqs, plain)

    observe_catch_up = spec.policy.observe_catch_up

    def caught_up(*args: Any) -> None:
        told.append(args[1])
        observe_catch_up(*args)

    measured: list[float] = []  # each measured step's seconds, in step order
    measure = spec.measured

    def measuring(num_seqs: int, num_drafting: int, num_tokens: int, seconds: float) -> None:
        measured.append(seconds)
        measure(num_seqs, num_drafting, num_tokens, seconds)

    spec.while_plain_step = while_plain_step  # type: ignore[method-assign]
    spec.measured = measuring  # type: ignore[method-assign]
    spec.policy.choose = choose  # type: ignore[method-assign]
    spec.policy.observe_step = observed  # type: ignore[method-assign]
    spec.policy.observe_catch_up = caught_up  # type: ignore[method-assign]
    spec.policy.observe_plain = observed_plain  # type: ignore[method-assign]
    steps: list[tuple[list[tuple[str, bool]], int]] = []  # per step: its calls, the draft length it ran

    def drive(engine: Engine) -> dict[str, Result]:
        """a alone, b joining at the 7th step."""
        first, second = prompts(2, model.config.vocab_size, seed=5)
        engine.add_request(request("a", first, max_tokens=40, ignore_eos=True))
        results: dict[str, Result] = {}
        num_steps = 0
        while engine.has_unfinished:
            calls.clear()
            now[0] = num_steps
            collect(results, engine.step())
            steps.append((list(calls), engine.spec.k if engine.spec is not None else 0))
            num_steps += 1
            if num_steps == 6:
                engine.add_request(request("b", second, max_tokens=4, ignore_eos=True))
        return results

    got = drive(engine)
    R = PLAIN_REASK
    assert steps[0][0] == [("choose", False)]  # the prompt's step (not measured, nothing chosen ahead)
    assert steps[1][0] == [("choose", False), ("choose", True)]  # the first decode step, then ahead
    for at in (2, 3, 4, 5):  # the choice made ahead stands
        assert steps[at] == ([], 0), at
    assert steps[6][0] == [("observe", False)] * 5 + [("choose", False)]  # b's prompt joins: a new load
    # a alone again: a choice before its first step, one ahead, then one ahead every R steps, each
    # after the measurements of the steps since the last
    assert steps[7][0] == [("choose", False), ("choose", True)]  # a and b decode
    alone = next(at for at in range(8, len(steps)) if ("choose", False) in steps[at][0])  # b has ended
    assert steps[alone][0] == [("observe", False)] * (alone - 7) + [("choose", False), ("choose", True)]
    asks = [at for at in range(alone, len(steps)) if ("choose", True) in steps[at][0]]
    assert asks[:2] == [alone, alone + R], asks
    assert steps[alone + R][0] == [("observe", True)] * R + [("choose", True)]
    assert all(steps[at] == ([], 0) for at in range(alone + 1, alone + R))
    assert drafts_at == [asks[1]]
    assert [n for n, (_, k) in enumerate(steps) if k] == [asks[1] + 1]  # the step after drafted
    assert steps[asks[1] + 1][0] == [("observe", False)]  # a drafting step: told at once, nothing ahead
    assert steps[asks[1] + 2][0][0] == ("choose", False)  # after it the policy chooses before the step
    assert told == measured[: len(told)] and len(measured) - len(told) <= R  # every one, in order
    want = drive(graphed(model, 0))
    assert {r: v.token_ids for r, v in got.items()} == {r: v.token_ids for r, v in want.items()}


def markov_engine(target: torch.Tensor, draft: torch.Tensor, *, max_num_seqs: int) -> Engine:
    """A `mtp:3` engine over the toy Markov model (`target`, `draft` [V, V] logits), m = 0.25."""
    config = EngineConfig.build(
        num_pages=1024, page_size=4, max_num_batched_tokens=96, max_num_seqs=max_num_seqs,
        num_speculative_tokens=3, speculative_max_seqs=max_num_seqs, speculative_draft_cost=0.25,
    )  # fmt: skip
    return Engine(MarkovModel(target, draft), config, vocab_size=target.shape[0], context_window=512)


@pytest.mark.parametrize("every", [5, 50])
def test_held_plain_steps_count_towards_starved_probes(monkeypatch: pytest.MonkeyPatch, every: int) -> None:
    """Acceptance alone keeps drafting off (its drafts are rejected), requests arriving every `every`
    steps: the acceptance-starved probes come as often in steps as when the policy was asked every
    step (`PLAIN_REASK` = 1), whether a stream's hold runs its course or an arrival breaks it (the
    held steps then count at the next ask)."""
    import backend.engine.speculative.decoder as decoder

    V = 16
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3
    draft = torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 3

    def probes(reask: int) -> int:
        monkeypatch.setattr(decoder, "PLAIN_REASK", reask)
        engine = markov_engine(target, draft, max_num_seqs=16)
        spec = engine.spec
        assert spec is not None
        runs, last_k, n = 0, 0, 0
        for step in range(1200):
            if step % every == 0:
                engine.add_request(request(f"r{n}", [n % V] * 3, max_tokens=3 * every, ignore_eos=True))
                n += 1
            spec.policy.acceptance = spec.policy.recent = [0.02] * 3  # starved throughout
            engine.step()
            runs += bool(spec.k and not last_k)
            last_k = spec.k
        return runs

    every_step, held = probes(1), probes(PLAIN_REASK)
    assert every_step > 30
    assert abs(held - every_step) <= 0.15 * every_step, (held, every_step)


# ---- a load priced to lose: the decoder's work a step, not a pass over its sequences --------------


def losing(engine: Engine) -> None:
    """A measuring policy (m as a nano model's) whose every load has measured its plain steps and
    every draft length far dearer, with no probe affordable: it is asked every step and says k = 0
    (lab/diagnostics/spec_plain_host.py `priced_to_lose`)."""
    spec = engine.spec
    assert spec is not None and spec.policy.is_calibrated
    policy = spec.policy
    policy.draft_cost = policy.prior_draft_cost = 0.25
    spec.max_drafting_seqs = policy.max_paying_seqs(spec.max_seqs)
    for n in range(spec.max_seqs.bit_length() + 1):
        policy._rates[1 << n] = LoadRates(
            plain=1.0, num_plain=MIN_RATE_SAMPLES, plain_step_s=1e-3, draft_step_s=1e9, num_probes=1,
            step_s_by_k={k: (1e9, 0) for k in range(1, policy.max_drafts + 1)},
        )  # fmt: skip


def test_a_decode_stream_priced_to_lose_asks_no_sequence(monkeypatch: pytest.MonkeyPatch) -> None:
    """16 sequences decode at a load where drafting loses (issue 28: such plain steps ran 3-5% slower
    than speculation off on the H100, host-bound): once their prompts have run, each step's
    speculative work is the policy's and no pass over the sequences (whether each one samples, may
    ever draft, has drafts pending). A request that may never draft (a grammar) makes the steps it
    runs in ask each sequence again; once it ends they ask none. Outputs as with speculation off."""
    engine = toy(3, speculative_draft_cost=None)
    losing(engine)
    spec = engine.spec
    assert spec is not None and spec.max_drafting_seqs >= 17
    asked: Counter[str] = Counter()

    def counted(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kw: Any) -> Any:
            asked[name] += 1
            return fn(*args, **kw)

        return wrapper

    needs_sample = ScheduledSeq.needs_sample.fget
    assert needs_sample is not None
    monkeypatch.setattr(ScheduledSeq, "needs_sample", property(counted("needs_sample", needs_sample)))
    monkeypatch.setattr(DraftBook, "can_ever_draft", counted("can_ever_draft", DraftBook.can_ever_draft))
    monkeypatch.setattr(DraftBook, "num_pending", counted("num_pending", DraftBook.num_pending))
    monkeypatch.setattr(spec.policy, "choose", counted("choose", spec.policy.choose))
    reqs = [request(f"r{i}", [i % 16] * 3, max_tokens=30) for i in range(16)]
    for r in reqs:
        engine.add_request(r)
    results: dict[str, Result] = {}
    steps: list[tuple[bool, Counter[str]]] = []  # per step: a never-drafting request live, the asks
    while engine.has_unfinished:
        if len(steps) == 10:
            engine.add_request(
                request("g", [5], max_tokens=6, temperature=1.0, seed=1), constraint=EvenTokensOnly()
            )
        asked.clear()
        is_guarded = "g" in engine._seqs  # live, so the book knows a request that may never draft
        collect(results, engine.step())
        assert spec.k == 0
        steps.append((is_guarded, Counter(asked)))
    per_sequence = ("needs_sample", "can_ever_draft", "num_pending")
    gaps = [b - a for a, b in itertools.pairwise([at for at, (_, c) in enumerate(steps) if c["choose"]])]
    assert max(gaps) <= PLAIN_REASK  # the policy decides every PLAIN_REASK steps at most
    for at, (is_guarded, counts) in enumerate(steps[1:], start=1):  # after the prompts' step
        if not is_guarded:
            assert not any(counts[name] for name in per_sequence), (at, counts)
    assert all(counts["can_ever_draft"] >= 16 for is_guarded, counts in steps if is_guarded)
    plain = run_all(toy(0), reqs)
    assert {r.request_id: results[r.request_id].token_ids for r in reqs} == {
        k: v.token_ids for k, v in plain.items()
    }


@pytest.mark.parametrize("is_accepted", [True, False], ids=["accepted", "rejected"])
def test_a_step_counted_without_a_pass_decides_as_one_with_it(
    monkeypatch: pytest.MonkeyPatch, is_accepted: bool
) -> None:
    """A scripted run (a few requests drafting, a burst past the draft cap, its tail back under it
    with catch-ups and a long prompt in chunks; a grammar and stop strings among them; drafts all
    accepted or mostly rejected, so the policy drafts and stops at every kind of step): every step chooses
    the same k, drafts the same sequences, fills the same prompt chunks and measures the same tokens
    whether its load is counted without a pass over the sequences (as served) or with one
    (`SchedulerOutput.is_decodes_only` never true, each decode's pending drafts asked and none
    dropped: as before), and the policy ends in the same state. A plain step's tokens are its
    outputs' tokens."""
    V = 16
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3
    draft = target if is_accepted else torch.randn(V, V, generator=torch.Generator().manual_seed(1)) * 3

    def run(is_pass: bool) -> tuple[list[tuple[Any, ...]], dict[str, list[int]], dict[str, Any]]:
        with monkeypatch.context() as m:
            if is_pass:
                m.setattr(SchedulerOutput, "is_decodes_only", property(lambda self: False))
                m.setattr(
                    DraftBook, "num_pending_rows", lambda self, d: sum(self.num_pending(s.seq) for s in d)
                )
            engine = markov_engine(target, draft, max_num_seqs=64)
            spec = engine.spec
            assert spec is not None and 4 < spec.max_drafting_seqs < 60
            measured: list[tuple[int, int, int]] = []
            tell = spec.measured

            def measure(num_seqs: int, num_drafting: int, num_tokens: int, seconds: float) -> None:
                measured.append((num_seqs, num_drafting, num_tokens))
                tell(num_seqs, num_drafting, num_tokens, seconds)

            chosen: list[tuple[int, list[str], bool]] = []  # k, the drafting requests, chunks filled
            choose = spec.drafting

            def drafting(out: SchedulerOutput, num_requests: int) -> list[bool]:
                flags = choose(out, num_requests)
                ids = [s.seq.request_id for s, f in zip(out.scheduled, flags, strict=True) if f]
                chosen.append((spec.k, ids, spec.fills_draft_kv))
                return flags

            spec.measured = measure  # type: ignore[method-assign]
            spec.drafting = drafting  # type: ignore[method-assign]
            for i in range(4):
                engine.add_request(request(f"a{i}", [i] * (3 + 40 * (i % 2)), max_tokens=80))
            records: list[tuple[Any, ...]] = []
            results: dict[str, Result] = {}
            while engine.has_unfinished:
                if len(records) == 12:
                    for i in range(56):
                        sampling: dict[str, Any] = {"stop": ["x"]} if i % 9 == 0 else {}
                        engine.add_request(
                            request(f"b{i}", [i % V] * (2 + i % 7), max_tokens=4 + i, **sampling)
                        )
                    engine.add_request(request("g", [5], max_tokens=8, seed=3), constraint=EvenTokensOnly())
                if len(records) == 60:  # the tail: a prompt over a step's budget
                    engine.add_request(request("late", [7] * 150, max_tokens=6))
                chosen.clear()
                measured.clear()
                outputs = engine.step()
                collect(results, outputs)
                records.append((list(chosen), list(measured)))
                if measured and not measured[0][1]:  # a plain decode step: a token a sampled sequence
                    assert measured[0][2] == sum(len(o.token_ids) for o in outputs)
            state = spec.policy_state()
            return records, {r: v.token_ids for r, v in results.items()}, state

    fast, fast_tokens, fast_state = run(is_pass=False)
    slow, slow_tokens, slow_state = run(is_pass=True)
    assert fast == slow
    assert fast_tokens == slow_tokens
    assert fast_state == slow_state
    ks = [chosen[0][0] for chosen, _ in fast if chosen]
    assert any(ks) and not all(ks)  # drafting and plain steps both

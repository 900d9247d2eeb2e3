"""The reasoning guard (backend/engine/constraint.py `TokenGuard`, issue 26): a request that reasons
cannot end its turn inside an open `<think>` block, with or without speculative decoding.

The guard's state is checked against the reasoning parser's own reading of the markers
(`ThinkMarkers.is_open_after`); the engine's outputs against a Markov toy whose next-token
logits are known (tests/backend/speculative_toy.py), so the tokens a guarded request must emit
are written out here; and nano GLM's empty answers (the issue's symptom) through the serving layer.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import msgspec
import pytest
import torch

from backend.engine.constraint import TokenGuard
from backend.engine.engine import Engine
from backend.engine.model_runner import SeqResult
from backend.engine.sampler import Sampler, SampleRow
from backend.engine.speculative.accept import banned_rows
from backend.engine.speculative.greedy import MAX_BANNED, guard_rows
from backend.engine.speculative.plan import SpecRow
from backend.text.reasoning import ThinkMarkers
from kernels.verify_accept import mask_guarded
from schemas.backend import EngineRequest, ReasoningMarkers, SamplingParams
from tests.backend.engine.test_engine import EvenTokensOnly
from tests.backend.engine.test_speculative import (
    ARCHS,
    OracleDrafts,
    chi2_p_value,
    engine_for,
    loaded,
    prompts,
    toy_engine,
)
from tests.backend.engine.test_speculative_greedy import graphed, lockstep
from tests.backend.engine_helpers import Result, request, run_all
from tests.backend.speculative_toy import MarkovModel

__all__ = ["loaded"]  # the fixture

EOS, START, END = 0, 1, 2  # the toy's end of turn, `<think>`, `</think>`
MARKERS = ThinkMarkers(START, END)


def guarded(req: EngineRequest, *, is_open: bool, eos: list[int] | None = None) -> EngineRequest:
    return msgspec.structs.replace(
        req,
        eos_token_ids=[EOS] if eos is None else eos,
        reasoning_markers=ReasoningMarkers(start_id=MARKERS.start_id, end_id=MARKERS.end_id, is_open=is_open),
    )


# ---- the guard alone ---------------------------------------------------------------------------
def test_stop_ids_are_banned_only_while_the_block_is_open() -> None:
    guard = TokenGuard(START, END, [EOS, 7], is_open=True)  # the prompt ended in <think>
    assert guard.banned_ids() == (EOS, 7)
    mask = guard.allowed_tokens(10)
    assert mask is not None and mask.tolist() == [i not in (EOS, 7) for i in range(10)]
    guard.accept(5)
    assert guard.banned_ids() == (EOS, 7)
    guard.accept(END)
    assert guard.banned_ids() == () and guard.allowed_tokens(10) is None
    guard.accept(EOS)  # an ordinary id once closed
    assert guard.banned_ids() == ()
    guard.accept(START)  # the model opens a block of its own
    assert guard.banned_ids() == (EOS, 7)
    assert not guard.is_finished()


def test_a_block_the_prompt_did_not_open_bans_nothing_until_the_model_opens_one() -> None:
    guard = TokenGuard(START, END, [EOS], is_open=False)
    assert guard.banned_ids() == () and guard.allowed_tokens(10) is None
    guard.accept(START)
    assert guard.banned_ids() == (EOS,)
    guard.rollback(1)
    assert guard.banned_ids() == ()


def test_a_request_gets_a_guard_only_when_it_reasons_and_eos_would_stop_it() -> None:
    req = request("r", [3, START])
    assert TokenGuard.of(msgspec.structs.replace(req, eos_token_ids=[EOS])) is None  # no markers
    guard = TokenGuard.of(guarded(req, is_open=True, eos=[EOS, 9]))
    assert guard is not None and guard.banned_ids() == (EOS, 9)
    ignoring = guarded(request("r", [3, START], ignore_eos=True), is_open=True)
    assert TokenGuard.of(ignoring) is None  # eos does not end it: nothing to ban


def test_ids_kept_out_always_are_banned_open_or_closed() -> None:
    """`always` (a chat's unoffered tool-call markers): banned at every token, beside the stop ids
    while a block is open; a request without markers gets a guard for them alone, and under
    `ignore_eos` too (only the stop ids depend on eos)."""
    guard = TokenGuard(START, END, [EOS], is_open=True, always=(11, 12, EOS))
    assert guard.banned_ids() == (EOS, 11, 12) and guard.max_banned == 3
    guard.accept(END)
    assert guard.banned_ids() == (11, 12, EOS)
    mask = guard.allowed_tokens(16)
    assert mask is not None and mask.tolist() == [i not in (11, 12, EOS) for i in range(16)]
    guard.accept(START)
    mask = guard.allowed_tokens(16)
    assert mask is not None and not mask[EOS] and not mask[11]
    alone = TokenGuard.of(
        msgspec.structs.replace(request("r", [3], ignore_eos=True), banned_token_ids=[11, 12, 11])
    )
    assert alone is not None and alone.banned_ids() == (11, 12) and alone.max_banned == 2
    alone.accept(START)  # no block to open: the markers mean nothing to it
    assert alone.banned_ids() == (11, 12) and alone.banned_along([START, END]) == [(11, 12)] * 3
    assert TokenGuard.of(request("r", [3])) is None


@pytest.mark.parametrize("seed", range(4))
def test_rollback_is_exact_across_opens_and_closes(seed: int) -> None:
    """Random accepts and rollbacks over ids rich in markers: the guard's state is always the
    parser's reading of the prompt and the tokens still kept; `banned_along` leaves it as it was."""
    rng = random.Random(seed)
    prompt = rng.choice([[3, START], [3, START, 4, END], [3]])
    guard = TokenGuard(START, END, [EOS], is_open=MARKERS.is_open_after(prompt))
    kept: list[int] = []
    for _ in range(400):
        if kept and rng.random() < 0.35:
            n = rng.randint(1, min(4, len(kept)))
            guard.rollback(n)
            del kept[len(kept) - n :]
        else:
            token = rng.choice([START, END, 3, 4, EOS])
            guard.accept(token)
            kept.append(token)
        assert guard.is_open == MARKERS.is_open_after(prompt + kept)
        drafts = [rng.choice([START, END, 5]) for _ in range(3)]
        along = guard.banned_along(drafts)
        assert along == [
            (EOS,) if MARKERS.is_open_after(prompt + kept + drafts[:i]) else () for i in range(4)
        ]
        assert guard.is_open == MARKERS.is_open_after(prompt + kept)


def test_the_sampler_masks_banned_ids_beside_a_grammar() -> None:
    """Greedy and sampled rows, free or under a grammar (even ids only): the guard's ids never
    come out; a grammar that allows nothing else keeps its say (the request may end)."""
    V = 10
    x = torch.full((4, V), -5.0)
    x[:, EOS] = 9.0  # everything wants to stop
    x[:, 4] = 5.0
    x[:, 3] = 6.0
    even = EvenTokensOnly().allowed_tokens(V)
    only_eos = torch.zeros(V, dtype=torch.bool)
    only_eos[EOS] = True

    def row(temperature: float, allowed: torch.Tensor | None, banned: tuple[int, ...]) -> SampleRow:
        params = SamplingParams(temperature=temperature)
        r = SampleRow(params, torch.Generator().manual_seed(0), [], 0, allowed=allowed)
        r.banned_ids = banned
        return r

    rows = [row(0.0, None, (EOS,)), row(0.0, even, (EOS,)), row(0.0, only_eos, (EOS,)), row(0.0, None, ())]
    assert [s.token_id for s in Sampler().sample(x.clone(), rows)] == [3, 4, EOS, EOS]
    for seed in range(20):
        r = row(2.0, even, (EOS,))
        r.generator.manual_seed(seed)
        assert Sampler().sample(x[:1].clone(), [r])[0].token_id in {2, 4, 6, 8}


# ---- the engine -------------------------------------------------------------------------------
V = 16


def toy_target() -> torch.Tensor:
    """After `<think>`: 5, 6, then eos is the favourite (the bug) and `</think>` the runner-up;
    after `</think>`: 7, 8, eos. Every other id is far behind."""
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0))
    for x, nxt in ((START, 5), (5, 6), (6, EOS), (END, 7), (7, 8), (8, EOS)):
        target[x, nxt] += 12.0
    target[6, END] += 10.0
    return target


@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_model_that_would_stop_inside_the_block_closes_it_first(k: int) -> None:
    """Greedy, plain and speculative (the head proposes eos inside the block: verify must reject it,
    in whole greedy steps on the device too): the guarded request writes `</think>` where it would
    have stopped; without the guard it ends inside the block. max_tokens still cuts."""
    target = toy_target()
    bare = request("bare", [3, START], max_tokens=12)
    results = run_all(toy_engine(MarkovModel(target, target), k), [
        msgspec.structs.replace(bare, eos_token_ids=[EOS]),
        guarded(msgspec.structs.replace(bare, request_id="open"), is_open=True),
        guarded(request("cut", [3, START], max_tokens=2), is_open=True),
        # the prompt closed its block: nothing to guard, it stops where the model does
        guarded(request("closed", [START, 5, END, 6], max_tokens=12), is_open=False),
    ])  # fmt: skip
    assert results["bare"].token_ids == [5, 6, EOS] and results["bare"].finish_reason == "stop"
    assert results["open"].token_ids == [5, 6, END, 7, 8, EOS] and results["open"].finish_reason == "stop"
    assert results["cut"].token_ids == [5, 6] and results["cut"].finish_reason == "length"
    assert results["closed"].token_ids == [EOS]


def test_a_block_the_model_opens_itself_is_guarded_too() -> None:
    target = toy_target()
    target[3, START] += 12.0  # the prompt's last token leads into <think>
    results = run_all(
        toy_engine(MarkovModel(target, target), 2), [guarded(request("r", [3], max_tokens=12), is_open=False)]
    )
    assert results["r"].token_ids == [START, 5, 6, END, 7, 8, EOS]


def greedy_chain(target: torch.Tensor, last: int, banned: set[int], max_tokens: int) -> list[int]:
    """The Markov toy's greedy output after `last` with `banned` masked at every step (the reference)."""
    out: list[int] = []
    while len(out) < max_tokens:
        row = target[last].clone()
        row[list(banned)] = float("-inf")
        last = int(row.argmax())
        out.append(last)
        if last == EOS:
            break
    return out


@pytest.mark.parametrize("k", [0, 1, 3])
def test_ids_banned_always_never_come_out_plain_or_speculative(k: int) -> None:
    """Issue 26: a chat offered no tools whose model opens a call anyway (the toy's favourite after
    3 and after 7 is the "marker" 12): with the family's markers banned it writes its next best
    instead, plain or speculative (drafts propose 12: verify takes it away, on the device too), as
    the masked greedy chain says; beside an open reasoning block's guard as well. Unbanned, 12
    comes out."""
    target = toy_target()
    target[3, 12] += 30.0
    target[7, 12] += 30.0
    bare = msgspec.structs.replace(request("bare", [4, 3], max_tokens=10), eos_token_ids=[EOS])
    banned = msgspec.structs.replace(bare, request_id="banned", banned_token_ids=[12, 13])
    both = guarded(
        msgspec.structs.replace(banned, request_id="both", prompt_token_ids=[3, START]), is_open=True
    )
    results = run_all(toy_engine(MarkovModel(target, target), k), [bare, banned, both])
    assert results["bare"].token_ids[0] == 12
    assert results["banned"].token_ids == greedy_chain(target, 3, {12, 13}, 10)
    assert results["both"].token_ids[:4] == [5, 6, END, 7]  # the block closed, not ended
    assert results["both"].token_ids == [5, 6, END, 7, *greedy_chain(target, 7, {12, 13}, 6)]
    assert not {12, 13} & {*results["banned"].token_ids, *results["both"].token_ids}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("k", [1, 3])
def test_speculative_output_equals_plain_with_the_guard_on(loaded: dict[str, Any], arch: str, k: int) -> None:
    """Tiny random checkpoints, oracle drafts (runs of every length accepted). Each request's eos is
    an id its free run emits early, its end marker one its guarded run emits while the block stays
    open, so the guard bites and blocks close inside verify steps: a guarded request differs from
    the unguarded one exactly from an eos it may not take, and with drafts its tokens equal the
    plain run's, token for token: on the host path, in whole greedy steps on the device (which a
    guard banning ids no longer keeps off it), and in those over the verify graphs' buffers."""
    model = loaded[arch]
    ps = prompts(12, model.config.vocab_size, seed=30 + k)
    free = [request(f"r{i}", p, max_tokens=32) for i, p in enumerate(ps)]
    outs = run_all(engine_for(model, 0), free)
    start = int(torch.bincount(torch.tensor([t for r in outs.values() for t in r.token_ids])).argmax())
    eos_of = {r.request_id: next(t for t in outs[r.request_id].token_ids[1:] if t != start) for r in free}

    def with_markers(end_of: dict[str, int]) -> list[EngineRequest]:
        return [
            msgspec.structs.replace(
                r,
                eos_token_ids=[eos_of[r.request_id]],
                reasoning_markers=ReasoningMarkers(
                    start_id=start, end_id=end_of[r.request_id], is_open=i % 3 != 0
                ),
            )
            for i, r in enumerate(free)
        ]

    never_closed = run_all(engine_for(model, 0), with_markers({r.request_id: -1 for r in free}))
    reqs = with_markers({
        rid: next((t for t in r.token_ids[4:] if t not in (start, eos_of[rid])), -1)
        for rid, r in never_closed.items()
    })  # fmt: skip
    unguarded = run_all(
        engine_for(model, 0), [msgspec.structs.replace(r, reasoning_markers=None) for r in reqs]
    )
    plain = run_all(engine_for(model, 0), reqs)
    host = engine_for(model, k)
    assert host.spec is not None
    host.spec.is_greedy_enabled = False
    OracleDrafts(host, plain, p_wrong=0.3)
    assert outputs(run_all(host, reqs)) == outputs(plain)  # the host path's verify masks each row
    # every prompt in the first step, so that the guards bite in whole steps (not beside prompt chunks)
    buffered = graphed(model, k, max_num_batched_tokens=256)  # through the verify graphs' buffers and padding
    num_guarded = guarded_greedy_steps(buffered)
    OracleDrafts(buffered, plain, p_wrong=0.3)
    assert outputs(run_all(buffered, reqs)) == outputs(plain)
    forwards = buffered.runner.spec_forwards
    assert forwards is not None and forwards.graphs is not None and buffered.spec is not None
    assert num_guarded[0] > 0 and forwards.graphs.num_greedy_replays == buffered.spec.num_greedy_steps
    engine = engine_for(model, k, max_num_batched_tokens=256)  # whole greedy steps, eager
    num_guarded = guarded_greedy_steps(engine)
    OracleDrafts(engine, plain, p_wrong=0.3)
    spec = run_all(engine, reqs)
    assert num_guarded[0] > 0  # a guard banned ids at verify rows of whole greedy steps
    num_changed = num_closed = 0
    for r in reqs:
        assert r.reasoning_markers is not None
        rid, eos, end = r.request_id, r.eos_token_ids[0], r.reasoning_markers.end_id
        got, want, before = spec[rid].token_ids, plain[rid].token_ids, unguarded[rid].token_ids
        assert got == want, rid
        assert spec[rid].finish_reason == plain[rid].finish_reason
        opened = [start] if r.reasoning_markers.is_open else []
        for i, t in enumerate(want):  # eos only where the block is closed
            assert t != eos or not ThinkMarkers(start, end).is_open_after(opened + want[:i]), rid
        num_closed += end in want
        n = next((i for i, (a, b) in enumerate(zip(before, want, strict=False)) if a != b), None)
        if n is not None:  # the first difference: where the unguarded run stopped inside the block
            num_changed += 1
            assert before[n:] == [eos] and want[n] != eos
    assert num_changed >= 4 and num_closed >= 4
    s = engine.stats
    assert (
        s.spec_accepted_tokens > 0
        and engine.block_manager.num_available_pages == engine.block_manager.num_pages
    )


def outputs(results: dict[str, Result]) -> dict[str, tuple[list[int], str | None]]:
    return {rid: (r.token_ids, r.finish_reason) for rid, r in results.items()}


def guarded_greedy_steps(engine: Engine) -> list[int]:
    """A counter, in a list, of `engine`'s whole greedy steps on the device in which some sequence's
    guard bans ids at a verify row (`_is_greedy` kept them all off it before)."""
    spec = engine.spec
    assert spec is not None
    run_greedy, count = spec._run_greedy, [0]

    def counting(rows: list[SpecRow], tag_updates: list[tuple[int, int]]) -> list[SeqResult]:
        count[0] += any(ids for r in rows for ids in banned_rows(r))
        return run_greedy(rows, tag_updates)

    spec._run_greedy = counting  # type: ignore[method-assign]
    return count


class EosDrafts:
    """After each step, the drafts are the plain run's next tokens, each replaced by eos with
    probability `p_wrong`: markers open and close blocks inside verify steps, and eos is proposed
    where a guard must take it away."""

    def __init__(self, engine: Engine, plain: dict[str, Result], p_wrong: float, seed: int = 0) -> None:
        spec = engine.spec
        assert spec is not None
        rng, run = random.Random(seed), spec.run

        def oracle_run(*args: Any) -> list[SeqResult]:
            results = run(*args)
            for rid, (num_tokens, drafts) in list(spec.book.proposed.items()):
                at = num_tokens - engine._seqs[rid].num_prompt_tokens  # output index of the first draft
                truth = plain[rid].token_ids[at : at + len(drafts)]
                spec.book.proposed[rid] = (num_tokens, [EOS if rng.random() < p_wrong else t for t in truth])
            return results

        spec.run = oracle_run  # type: ignore[method-assign,assignment]


@pytest.mark.parametrize("k", [1, 2, 3])
def test_whole_greedy_steps_on_the_device_keep_the_guard(k: int) -> None:
    """The toy that would stop inside its block, looping through blocks it opens itself
    (`<think>` 5 6 `</think>` 7 8 `<think>` …): drafts the plain run's tokens or eos, so blocks open and
    close inside verify steps and eos is proposed inside them. Step by step the whole greedy steps
    on the device give the host path's tokens (and drafts, pool, acceptance), both plain decoding's,
    and they ran while guards banned ids."""
    target = toy_target()
    target[8, START] += 14.0  # after 8 the next block, not the end of the turn
    target[3, START] += 12.0
    reqs = [
        msgspec.structs.replace(request("bare", [3, START], max_tokens=32), eos_token_ids=[EOS]),
        guarded(request("open", [3, START], max_tokens=32 + k), is_open=True),
        guarded(request("opens", [3], max_tokens=31), is_open=False),
        guarded(request("closed", [START, 5, END, 6], max_tokens=32), is_open=False),
        guarded(request("two", [4, START], max_tokens=33), is_open=True, eos=[EOS, 9]),
    ]
    plain = run_all(toy_engine(MarkovModel(target, target), 0), reqs)
    loop = [5, 6, END, 7, 8, START]
    assert plain["bare"].token_ids == [5, 6, EOS]
    assert plain["open"].token_ids == (loop * 6)[: 32 + k]
    assert plain["opens"].token_ids == [START, *loop * 5][:31]
    assert plain["closed"].token_ids == [EOS]
    fast, slow = (toy_engine(MarkovModel(target, target), k) for _ in range(2))
    num_guarded = guarded_greedy_steps(fast)
    EosDrafts(slow, plain, p_wrong=0.3)  # `lockstep` hands the slow engine's drafts to the fast one
    got, _ = lockstep(fast, slow, reqs)
    assert outputs(got) == outputs(plain)
    assert num_guarded[0] >= 5


@pytest.mark.parametrize("k", [1, 2, 3, 4])
def test_the_device_mask_is_the_guard_along_the_drafts(k: int) -> None:
    """`mask_guarded` over `guard_rows` against `TokenGuard.banned_along` on random guards (open
    or closed, with a history, start and end ids that may coincide, stop ids repeated, 0 or past the
    vocabulary) and random drafts rich in their markers: -inf exactly at the banned ids in the
    vocabulary of each verify row, every other logit as it was; a sequence without a guard masks
    nothing; the guards are left as they were."""
    rng = random.Random(k)
    V, L = 12, k + 1
    guards: list[TokenGuard | None] = [
        TokenGuard(START, END, [0], is_open=True),  # the padding's clamp lands on id 0 too
        TokenGuard(START, END, [V - 1, V + 1], is_open=True),
        None,
    ]
    for _ in range(61):
        start, end = rng.randrange(V), rng.randrange(V)
        if rng.random() < 0.1:
            end = start
        stop_ids = [rng.randrange(V + 2) for _ in range(rng.randint(1, MAX_BANNED))]
        g = TokenGuard(start, end, stop_ids, is_open=rng.random() < 0.5)
        for _ in range(rng.randrange(4)):
            g.accept(rng.choice([start, end, rng.randrange(V)]))
        guards.append(g)
    drafts = [
        [rng.choice([g.start_id, g.end_id, rng.randrange(V)]) if g else rng.randrange(V) for _ in range(k)]
        for g in guards
    ]
    logits = torch.randn(len(guards) * L, V)
    was_open = [g.is_open if g else None for g in guards]
    rows = guard_rows(guards, drafts, V)
    assert (
        rows.shape == (len(guards), L, MAX_BANNED) and [g.is_open if g else None for g in guards] == was_open
    )
    masked = mask_guarded(logits.clone(), torch.from_numpy(rows))
    num_banned_rows = 0
    for b, (maybe, ds) in enumerate(zip(guards, drafts, strict=True)):
        along = maybe.banned_along(ds) if maybe is not None else [()] * L
        for i in range(L):
            row = b * L + i
            want = {t for t in along[i] if t < V}
            is_inf = masked[row] == float("-inf")
            assert set(torch.nonzero(is_inf)[:, 0].tolist()) == want, (b, i)
            assert torch.equal(masked[row][~is_inf], logits[row][~is_inf])
            num_banned_rows += bool(want)
    assert num_banned_rows > len(guards) * L // 4


def test_the_device_mask_is_four_launches() -> None:
    """The whole step's masking, a node each in its graph: a compare, a select, a clamp and the
    scatter, at any k (walking the guard along the drafts there took 17 at k = 3: the host knows
    the drafts, `guard_rows` walks it)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tests.backend.engine.test_speculative_host import NO_LAUNCH

    class Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            out = func(*args, **(kwargs or {}))
            name = str(func.overloadpacket.__name__)
            # scalar_tensor: a 0-dim host wrapper of where's scalars, no launch
            if name not in {*NO_LAUNCH, "scalar_tensor"} and not (name == "to" and out is args[0]):
                self.names.append(name)
            return out

    guard = TokenGuard(START, END, [1, 2], is_open=True)
    for k in (1, 3, 5):
        rows = torch.from_numpy(guard_rows([guard, None], [[END, *[3] * (k - 1)], [3] * k], 12))
        logits = torch.randn(2 * (k + 1), 12)
        with Ops() as ops:
            mask_guarded(logits, rows)
        assert sorted(ops.names) == ["clamp", "ge", "scatter_add_", "where"], (k, ops.names)
        assert torch.isinf(logits[0, [1, 2]]).all() and not torch.isinf(logits[1:]).any()  # END closes it


def test_sampled_speculative_outputs_follow_the_guarded_target() -> None:
    """χ² on whole outputs of four tokens drawn by a verify of two drafts from a noisy head: the
    distribution is the target's with eos taken out while the block is open, and ends at eos once
    it is closed."""
    n_vocab, N = 6, 3000
    g = torch.Generator().manual_seed(2)
    target = torch.randn(n_vocab, n_vocab, generator=g)
    target[:, EOS] += 1.0  # eos is likely everywhere: the guard has work to do
    draft = target + torch.randn(n_vocab, n_vocab, generator=g)
    engine = toy_engine(MarkovModel(target, draft), 2)
    reqs = [
        guarded(request(f"r{i}", [3, START], max_tokens=4, temperature=1.0, seed=i), is_open=True)
        for i in range(N)
    ]
    counts: dict[tuple[int, ...], int] = {}
    for batch in range(0, N, 64):
        for r in run_all(engine, reqs[batch : batch + 64]).values():
            counts[tuple(r.token_ids)] = counts.get(tuple(r.token_ids), 0) + 1
    expected: dict[tuple[int, ...], float] = {}

    def walk(tokens: tuple[int, ...], p: float) -> None:
        if len(tokens) == 4 or (tokens and tokens[-1] == EOS):
            expected[tokens] = p
            return
        x = target[tokens[-1] if tokens else START].double()
        if MARKERS.is_open_after([START, *tokens]):
            x = x.clone()
            x[EOS] = float("-inf")
        for t, q in enumerate(torch.softmax(x, dim=-1).tolist()):
            if q > 0:
                walk((*tokens, t), p * q)

    walk((), 1.0)
    assert set(counts) <= set(expected)  # no eos inside the block, ever
    keys = sorted(expected)
    observed = torch.tensor([counts.get(key, 0) for key in keys], dtype=torch.float64)
    assert chi2_p_value(observed, torch.tensor([expected[key] for key in keys], dtype=torch.float64)) > 1e-3
    s = engine.stats
    assert 0.2 < s.spec_accepted_tokens / s.spec_drafted_tokens < 0.9  # accepts and rejects both ran


# ---- nano GLM through the serving layer (the symptom) ------------------------------------
GLM = Path("models/glm-5.2-nano")
EVERYDAY = [
    "Hi!", "Good morning!", "What is the capital of France?", "What is 2 + 2?", "Who wrote Romeo and Juliet?",
    "How many legs does a spider have?", "Tom has 3 apples and buys 5 more. How many apples does he have?",
    "Sara had 12 cookies and ate 4. How many are left?",
    "A pizza has 8 slices shared by 4 friends. How many slices each?",
    "Half of 48 is what?", "Tell me a short joke.", "Give me a synonym for happy.", "What's a healthy snack?",
    "Describe a sunset in five words.", "Anna is 9 and her brother is 4 years older. How old is he?",
    "If a pen costs 2 dollars, how much do 6 pens cost?",
    # the two of lab/diagnostics/think_guard_e2e.py's 60 that the retrained GLM nano (2026-12-05) still
    # ends inside the block, unguarded (9 of 60 before it)
    "What is the largest planet?", "Give me a tip for sleeping better.",
]  # fmt: skip


@pytest.mark.skipif(not (GLM / "model.safetensors.index.json").exists(), reason="nano GLM not in models/")
def test_nano_glm_no_longer_ends_its_turn_inside_think() -> None:
    """Greedy, reasoning on by default (the prompt ends in `<think>`): unguarded, some answers are
    empty, the turn ended inside the block; guarded, none is, and each output is the unguarded one
    up to the eos the guard took away."""
    from backend.server.generation import Serving
    from backend.server.model_card import ServedModel
    from backend.server.rank_group import build_engine
    from backend.server.settings import BackendSettings
    from schemas.backend import GenerateRequest, Message

    served = ServedModel.from_checkpoint(GLM)
    engine: Engine = build_engine(BackendSettings(model=str(GLM), port=1, secret="x" * 32, dtype="float32"))
    serving = Serving(served, engine)  # type: ignore[arg-type]  # only `prepare` is used
    reqs = [
        serving.prepare(GenerateRequest(
            request_id=f"p{i}", tenant_salt="a" * 32, messages=[Message(role="user", content=text)],
            sampling=SamplingParams(temperature=0.0, max_tokens=96),
        )).engine_request
        for i, text in enumerate(EVERYDAY)
    ]  # fmt: skip
    think = served.think
    assert think is not None and all(
        r.reasoning_markers is not None and r.reasoning_markers.is_open for r in reqs
    )
    before = run_all(engine, [msgspec.structs.replace(r, reasoning_markers=None) for r in reqs])
    after = run_all(engine, reqs)

    def ends_inside(r: EngineRequest, result: Result) -> bool:
        return result.finish_reason == "stop" and think.is_open_after(r.prompt_token_ids + result.token_ids)

    assert sum(ends_inside(r, before[r.request_id]) for r in reqs) >= 2
    for r in reqs:
        got, was = after[r.request_id], before[r.request_id]
        assert not ends_inside(r, got), r.request_id
        if ends_inside(r, was):
            assert got.token_ids[: len(was.token_ids) - 1] == was.token_ids[:-1]
            assert got.token_ids[len(was.token_ids) - 1] not in r.eos_token_ids
        else:
            assert got.token_ids == was.token_ids


@pytest.mark.skipif(not (GLM / "tokenizer.json").exists(), reason="nano GLM not in models/")
def test_only_a_request_that_reasons_freely_carries_the_markers() -> None:
    """Reasoning on (GLM's default: the prompt opens the block), off, or a JSON answer (a grammar
    turns reasoning off): the guard's markers come with the first only."""
    from backend.server.generation import Serving
    from backend.server.model_card import ServedModel
    from schemas.backend import GenerateRequest, Message, Reasoning, ResponseFormat

    served = ServedModel.from_checkpoint(GLM)
    serving = Serving(served, None)  # type: ignore[arg-type]  # `prepare` never reaches the engine

    def markers(**fields: Any) -> ReasoningMarkers | None:
        request = GenerateRequest(
            request_id="r", tenant_salt="a" * 32, messages=[Message(role="user", content="Hi!")], **fields
        )
        return serving.prepare(request).engine_request.reasoning_markers

    think = served.think
    assert think is not None
    assert markers() == ReasoningMarkers(start_id=think.start_id, end_id=think.end_id, is_open=True)
    assert markers(reasoning=Reasoning(enabled=False)) is None
    assert markers(response_format=ResponseFormat(type="json_object")) is None


def test_a_tool_call_marker_closes_the_block_for_the_guard() -> None:
    """With tools offered the family's call-opening marker closes the block, as the reasoning parser
    reads it: after it the end-of-turn ids are allowed again (a call made from inside the reasoning
    may end the turn), and a rollback past it opens the block again."""
    START, END, CALL, EOS = 5, 6, 7, 2
    guard = TokenGuard(START, END, [EOS], is_open=True, call_start_id=CALL)
    assert guard.banned_ids() == (EOS,)
    guard.accept(11)
    guard.accept(CALL)
    assert guard.banned_ids() == () and not guard.is_open
    guard.rollback(1)
    assert guard.banned_ids() == (EOS,)
    assert guard.banned_along([CALL, 12]) == [(EOS,), (), ()]
    without = TokenGuard(START, END, [EOS], is_open=True)
    without.accept(CALL)
    assert without.banned_ids() == (EOS,)
    req = msgspec.structs.replace(
        request("r", [1], max_tokens=4),
        eos_token_ids=[EOS],
        reasoning_markers=ReasoningMarkers(start_id=START, end_id=END, is_open=True, call_start_id=CALL),
    )
    of = TokenGuard.of(req)
    assert of is not None and of.call_start_id == CALL


KIMI = Path("models/kimi-k2.6-nano")
# everyday questions offered no tools that the nano models answer with a call (markup and all) when
# nothing keeps its markers out (found by lab probes, 2026-12-07: 5 of 14 for GLM, 1 for Kimi)
UNOFFERED = {
    KIMI: ["What time is it in London?"],
    GLM: ["What's the weather in Paris?", "Is it raining in Madrid?", "Send an email to Bob saying hi."],
}


@pytest.mark.parametrize("path", [KIMI, GLM], ids=["kimi", "glm"])
def test_nano_models_offered_no_tools_write_no_call_markup(path: Path) -> None:
    """Issue 26: a chat that offers no tools (or `tool_choice: none`) bans every tool-call marker
    of the family; with tools offered none is banned. Greedy, the nano models open calls to these
    prompts when the ban is lifted; with it, no marker comes out and the text is plain."""
    if not (path / "model.safetensors.index.json").exists():
        pytest.skip(f"{path} not in models/")
    from backend.server.generation import Serving
    from backend.server.model_card import ServedModel
    from backend.server.rank_group import build_engine
    from backend.server.settings import BackendSettings
    from backend.text.tool_parsers import MARKERS as TOOL_MARKERS_OF
    from schemas.backend import GenerateRequest, Message, Tool, ToolChoice

    served = ServedModel.from_checkpoint(path)
    markers = {served.marker_ids[m] for m in TOOL_MARKERS_OF[served.family]}
    assert None not in markers
    engine: Engine = build_engine(BackendSettings(model=str(path), port=1, secret="x" * 32, dtype="float32"))
    serving = Serving(served, engine)  # type: ignore[arg-type]  # only `prepare` is used

    def prepared(i: int, text: str, **fields: Any) -> EngineRequest:
        return serving.prepare(GenerateRequest(
            request_id=f"p{i}", tenant_salt="a" * 32, messages=[Message(role="user", content=text)],
            sampling=SamplingParams(temperature=0.0, max_tokens=64), **fields,
        )).engine_request  # fmt: skip

    weather = Tool(
        name="get_weather", parameters={"type": "object", "properties": {"city": {"type": "string"}}}
    )
    assert prepared(0, "Hi", tools=[weather]).banned_token_ids == []
    refused = prepared(0, "Hi", tools=[weather], tool_choice=ToolChoice(mode="none"))
    assert set(refused.banned_token_ids) == markers
    reqs = [prepared(i, text) for i, text in enumerate(UNOFFERED[path])]
    assert all(set(r.banned_token_ids) == markers for r in reqs)
    unbanned = run_all(engine, [msgspec.structs.replace(r, banned_token_ids=[]) for r in reqs])
    banned = run_all(engine, reqs)
    for r in reqs:
        assert markers & set(unbanned[r.request_id].token_ids), r.request_id  # the ban is what holds
        assert not markers & set(banned[r.request_id].token_ids), r.request_id

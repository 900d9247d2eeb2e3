"""The draft policy (backend/engine/speculative/policy.py) replayed against one user's steps shaped
like the H100's of 2026-12-05 (benchmarks/results/2026-12-05-mtp-gpu.json, speedup_c1): short
requests one after another, each step observed as the engine observes it (backend/engine/engine.py
`step`). There the adaptive policy drafted in a few dozen of ~1,200 decode steps (0.89-0.94x plain)
while drafting K = 3 every step ran 1.28x on tool calls (E(3) ~3.1): its probe's three verifies
and a per-step EWMA of each step's rate (1 to 4 tokens a step) called a 10-30% win a loss, after
which a probe of a short-request load waited for ~5 runs' plain time."""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass, field

from backend.engine.speculative.policy import (
    EXPLORE_EVERY,
    EXPLORE_MAX_EVERY,
    MIN_RATE_SAMPLES,
    PROBE_VERIFIES,
    DraftPolicy,
    StepLoad,
)

PLAIN_S = 0.000435  # a plain decode step (graph replayed)
VERIFY_S, DRAFT_S = 0.00075, 0.0001  # a whole greedy step of k drafts: VERIFY_S + k · DRAFT_S
CATCH_UP_S = 0.003  # a step that catches up MTP KV (host path), then proposes
TOOL_CALL = [0.85, 0.8, 0.75]  # acceptance per depth: E(3) = 3.04
CHAT = [0.5, 0.4, 0.3]  # E(3) = 1.76


@dataclass
class Run:
    """One bench run's decode: its tokens and seconds, and the draft length of each decode step."""

    num_tokens: int = 0
    seconds: float = 0.0
    ks: list[int] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.num_tokens / self.seconds

    @property
    def num_drafting(self) -> int:
        return sum(1 for k in self.ks if k)


def replay(
    p: DraftPolicy | None,
    acceptance: list[float],
    rng: random.Random,
    *,
    num_requests: int = 8,
    length: int = 25,
    prompt: int = 300,
    fixed_k: int = 0,
    cold_s: float = 0.0,
) -> Run:
    """One user's `num_requests` requests of `length` tokens, one after another, through `p` (None:
    `fixed_k` drafts every step). A prefill step drafts or not as asked (its MTP KV then written, or
    left as a gap), unobserved (not decode-only); a decode step after a plain one catches the gap
    up (`observe_catch_up`), later ones verify: `observe`, `observe_step` and `observe_timing` (its
    draft forwards against its verify). `cold_s`: the first catch-up and the first verifying step
    take that long more (kernels compiled on their first call, as a fresh engine's are)."""
    run, cold = Run(), {"catch_up": cold_s, "verify": cold_s}
    for _ in range(num_requests):
        k = p.choose(StepLoad(num_rows=prompt, num_drafting=1)) if p is not None else fixed_k
        num_drafts, gap, left = k, 0 if k else prompt, length - 1
        while left > 0:
            k = p.choose(StepLoad(num_rows=1, num_drafting=1)) if p is not None else fixed_k
            jitter = rng.uniform(0.95, 1.05)
            if not k:  # plain: its MTP KV left unwritten
                n, seconds = 1, PLAIN_S * jitter
                num_drafts, gap = 0, gap + 1
                if p is not None:
                    p.observe_step(1, False, False, n, seconds)
            elif gap:  # catches up, proposes
                n, seconds = 1, CATCH_UP_S * jitter + cold.pop("catch_up", 0.0)
                num_drafts, gap = k, 0
                if p is not None:
                    p.observe_catch_up(1, seconds)
            else:  # verifies, proposes
                num_verified, num_accepted = min(k, num_drafts), 0
                while num_accepted < num_verified and rng.random() < acceptance[num_accepted]:
                    num_accepted += 1
                extra = cold.pop("verify", 0.0)  # in its draft forwards, compiled on their first call
                n, seconds = min(num_accepted + 1, left), (VERIFY_S + DRAFT_S * k) * jitter + extra
                num_drafts = k
                if p is not None:
                    p.observe(num_verified, num_accepted)
                    p.observe_step(1, True, True, n, seconds, k)
                    p.observe_timing(
                        VERIFY_S * jitter, 1 + num_verified, DRAFT_S * k * jitter + extra, [1] * k
                    )
            run.num_tokens, run.seconds, left = run.num_tokens + n, run.seconds + seconds, left - n
            run.ks.append(k)
    return run


def calibrated() -> DraftPolicy:
    return DraftPolicy(3, saturation_rows=64, draft_cost=0.25, is_calibrated=True)


def bench(
    acceptance: list[float], seed: int, num_runs: int = 7, cold_s: float = 0.0
) -> tuple[float, float, list[Run]]:
    """The bench's speedup_c1 shape: plain and fixed-k rates, then `num_runs` runs (a warm-up, its
    first drafting steps `cold_s` slower, and six) through one engine's policy."""
    rng = random.Random(seed)
    plain = replay(None, acceptance, rng).rate
    fixed = replay(None, acceptance, rng, fixed_k=3).rate
    p = calibrated()
    runs = [replay(p, acceptance, rng, cold_s=cold_s)]
    return plain, fixed, runs + [replay(p, acceptance, rng) for _ in range(num_runs - 1)]


def test_one_user_keeps_drafting_where_it_pays() -> None:
    """Tool calls (E(3) ~3.0, drafting K every step 1.10-1.26x here): after the warm-up run, every
    run drafts in most of its decode steps, none is slower than plain decoding and they average
    over 1.08x. (Before 2026-12-05 most runs drafted in no step at all: 0.95-1.0x.)"""
    for seed in range(5):
        plain, fixed, runs = bench(TOOL_CALL, seed)
        assert fixed > 1.05 * plain
        for run in runs[1:]:
            assert run.num_drafting > 0.25 * len(run.ks), seed  # ~3 tokens a drafting step
            assert run.rate > plain, seed
        assert sum(r.rate for r in runs[1:]) / len(runs[1:]) > 1.08 * plain, seed


def test_a_cold_start_does_not_turn_drafting_off() -> None:
    """The warm-up's first catch-up and first verify compile their kernels (+0.3 s each: a drafting
    step 400x its steady cost, a sample of m ~1,000x the 0.25 it starts from). On the H100
    (2026-12-05, session 14) such samples left m at 27.8 and a drafting step's seconds far above
    their steady value: no draft length paid again and no probe was affordable, so no later run
    drafted (speedup_c1 0.96-0.97x where drafting K every step ran 1.22-1.33x). Here the later runs
    draft as they do without the cold start, and m stays near its steady ~0.13."""
    for seed in range(5):
        plain, _, runs = bench(TOOL_CALL, seed, cold_s=0.3)
        for run in runs[1:]:
            assert run.num_drafting > 0.25 * len(run.ks), seed
            assert run.rate > plain, seed
    p = calibrated()
    replay(p, TOOL_CALL, random.Random(0), cold_s=0.3)
    assert p.draft_cost < 1.0


def test_one_user_stops_drafting_where_it_loses() -> None:
    """Chat (E(3) ~1.8, drafting K every step 0.7x here): probes only, within a few percent of
    plain decoding over the runs."""
    for seed in range(5):
        plain, fixed, runs = bench(CHAT, seed)
        assert fixed < 0.8 * plain
        ks = [k for run in runs for k in run.ks]
        assert sum(1 for k in ks if k) < 0.05 * len(ks), seed
        assert sum(r.num_tokens for r in runs) / sum(r.seconds for r in runs) > 0.97 * plain, seed


def drive_tokens(p: DraftPolicy, num_steps: int, tokens: list[int]) -> list[int]:
    """`num_steps` steps of one user: plain ones of PLAIN_S, drafting ones that verify in 1 ms and
    emit the next of `tokens` (cycled; the first drafting step after a plain one catches up and
    proposes). The draft lengths."""
    load, ks, last, i = StepLoad(num_rows=1, num_drafting=1), [], 0, 0
    for _ in range(num_steps):
        k = p.choose(load)
        if k and not last:
            p.observe_catch_up(1, CATCH_UP_S)
        elif k:
            p.observe_step(1, True, True, tokens[i % len(tokens)], 0.001)
            i += 1
        else:
            p.observe_step(1, False, False, 1, PLAIN_S)
        ks.append(k)
        last = k
    return ks


def test_a_short_run_of_poor_verifies_does_not_end_a_win() -> None:
    """Drafting measured at 3 tokens a 1 ms step (1.3x plain) keeps drafting through four verifies
    of one token each (four in a row: ~1 in 2,000 verifies at a_1 = 0.85), and stops within ~20
    verifies once it truly emits fewer tokens than plain steps would (1.5 a step)."""
    p = calibrated()
    ks = drive_tokens(p, 45, [3])
    first = ks.index(3)
    assert first == MIN_RATE_SAMPLES and all(ks[first:])  # the probe, then drafting
    assert all(drive_tokens(p, 4, [1]) + drive_tokens(p, 40, [3]))
    assert p.num_probes == 1
    ks = drive_tokens(p, 60, [1, 2])
    assert 0 < ks.index(0) <= 20 and not any(ks[20:])


def test_a_probe_measures_its_verifies_across_requests() -> None:
    """A probe ends after PROBE_VERIFIES verifies at one user, however many prefill steps (asked,
    not measured) fall within it."""
    p = calibrated()
    load, prefill = StepLoad(num_rows=1, num_drafting=1), StepLoad(num_rows=300, num_drafting=1)
    for _ in range(MIN_RATE_SAMPLES):
        assert p.choose(load) == 0
        p.observe_step(1, False, False, 1, PLAIN_S)
    assert p.choose(load) and p.num_probes == 1
    p.observe_catch_up(1, CATCH_UP_S)
    for i in range(PROBE_VERIFIES):
        if i % 4 == 0:
            assert p.choose(prefill)  # a new request's prefill: drafts, unobserved
        assert p.choose(load)
        p.observe_step(1, True, True, 2, 0.001)  # 2000 tokens/s: under plain's 2300, within its noise
    assert p.choose(load) == 0 and p.num_probes == 1  # measured whole: it lost


# The H100 of 2026-12-06 (benchmarks/results/2026-12-06-mtp-gpu.json), GLM nano tool calls: whole
# greedy steps on the device (no host timing of the draft forwards, so m stays where the host path left
# it), a drafting step ~1.79 + 0.145 k plain steps; per-depth acceptance with E(1) 1.93, E(3) 3.38
GREEDY_TOOL_CALL = [0.93, 0.85, 0.84]


def drive_whole_steps(p: DraftPolicy, num_steps: int, rng: random.Random) -> Run:
    """One long request of whole greedy steps: plain ones of PLAIN_S; a drafting one (after the first,
    which catches up) of (1.785 + 0.145 k) plain steps, emitting its accepted drafts and one more.
    As the engine reports them: `observe`, `observe_step` with its k; never `observe_timing`."""
    run, last, num_drafts = Run(), 0, 0
    load = StepLoad(num_rows=1, num_drafting=1)
    for _ in range(num_steps):
        k = p.choose(load)
        jitter = rng.uniform(0.97, 1.03)
        if not k:
            n, seconds = 1, PLAIN_S * jitter
            p.observe_step(1, False, False, n, seconds)
        elif not last:
            n, seconds = 1, CATCH_UP_S * jitter
            p.observe_catch_up(1, seconds)
        else:
            num_verified, a = min(k, num_drafts), 0
            while a < num_verified and rng.random() < GREEDY_TOOL_CALL[a]:
                a += 1
            n, seconds = a + 1, (1.785 + 0.145 * k) * PLAIN_S * jitter
            p.observe(num_verified, a)
            p.observe_step(1, True, True, n, seconds, k)
        num_drafts, last = k, k
        run.num_tokens, run.seconds = run.num_tokens + n, run.seconds + seconds
        run.ks.append(k)
    return run


def test_measured_step_costs_choose_the_draft_length() -> None:
    """m left at 0.7 by the host path prices k = 1 at 1.7 plain steps and k = 3 at 3.1, so the cost
    model alone drafts one token a step (E(1) 1.93 in ~1.93 plain steps: no gain; the H100 ran
    0.99x there). Measured verifying steps price each k at its seconds (a k not yet measured at
    the measured one's plus the starting m a depth: tried, then measured): after the start the
    policy drafts three a step (E(3) ~3.4 in ~2.2 plain steps, ~1.5x)."""
    for seed in range(3):
        p = DraftPolicy(3, saturation_rows=64, draft_cost=0.25, is_calibrated=True)  # 1 / 4 layers
        p.draft_cost = 0.7  # as host-path steps (eager drafts) measured it
        rng = random.Random(seed)
        drive_whole_steps(p, 200, rng)  # the start: plain steps, the probe, the first verifies
        run = drive_whole_steps(p, 1000, rng)
        assert run.ks.count(3) > 0.9 * len(run.ks), seed
        assert run.rate > 1.35 / PLAIN_S, seed  # plain decoding: 1 / PLAIN_S
        assert p.draft_cost == 0.7  # never timed on this path: the measured step costs decided


def replay_requests(p: DraftPolicy, acceptance: list[float], rng: random.Random, first_id: int) -> Run:
    """`replay`'s one user with the engine's request ids: each request's steps are chosen for it
    (`choose(load, (id,))`), its verifies observed as its own, and it is forgotten when it finishes.
    Its prompt's MTP KV is written by the prefill (the engine's fill step, or its drafting step,
    which proposes k drafts after the prompt); plain steps leave a gap its next drafting step
    catches up."""
    run = Run()
    for i in range(8):
        rid = (f"r{first_id + i}",)
        num_drafts, gap, left = p.choose(StepLoad(num_rows=300, num_drafting=1), rid), 0, 24  # unobserved
        while left > 0:
            k = p.choose(StepLoad(num_rows=1, num_drafting=1), rid, not num_drafts)
            jitter = rng.uniform(0.95, 1.05)
            n, seconds = 1, (VERIFY_S + DRAFT_S * k) * jitter
            if not k:
                n, seconds, num_drafts, gap = 1, PLAIN_S * jitter, 0, gap + 1
                p.observe_step(1, False, False, n, seconds)
            elif gap:
                seconds, num_drafts, gap = CATCH_UP_S * jitter, k, 0
                p.observe_catch_up(1, seconds)
            elif not num_drafts:  # proposes only
                num_drafts = k
                p.observe_step(1, True, False, n, seconds, k)
            else:
                num_verified, a = min(k, num_drafts), 0
                while a < num_verified and rng.random() < acceptance[a]:
                    a += 1
                n, num_drafts = min(a + 1, left), k
                p.observe(num_verified, a, rid[0])
                p.observe_step(1, True, True, n, seconds, k)
            run.num_tokens, run.seconds, left = run.num_tokens + n, run.seconds + seconds, left - n
            run.ks.append(k)
        p.forget(rid[0])
    return run


def test_each_kind_of_request_drafts_as_its_own_acceptance_says() -> None:
    """One engine, one user: chat (E(3) ~1.8, drafting loses) for six runs, then tool calls (E(3)
    ~3.0, drafting K 1.26x). With one acceptance shared by all requests and the load's measured
    verdict, the chat runs left tool calls plain for good in most seeds (runs at 1.0x, a probe
    now and then that measured chat-level drafts and lost; the H100 in 2026-12-06: Kimi tool calls
    0.93x after its chat runs, where session 16 drafted them at 1.15x). Priced at their own
    acceptance (and the recent requests'), a new request that the model keeps plain drafts now
    and then to measure its own (less often while that finds nothing): the tool runs draft, and
    chat pays little for the exploring."""
    for seed in range(3):
        rng = random.Random(seed)
        p, plain, ids = calibrated(), 1 / PLAIN_S, iter(range(0, 10_000, 8))
        chat = [replay_requests(p, CHAT, rng, next(ids)) for _ in range(6)]
        assert p.explore_every == EXPLORE_MAX_EVERY, seed  # explorations that found nothing: fewer
        tool = [replay_requests(p, TOOL_CALL, rng, next(ids)) for _ in range(8)]
        assert p.explore_every == EXPLORE_EVERY, seed  # one found a gain: as often as at first
        assert all(r.rate > 0.97 * plain for r in tool[2:]), seed
        assert statistics.fmean(r.rate for r in tool) > 1.1 * plain, seed
        assert statistics.fmean(r.rate for r in chat[1:]) > 0.95 * plain, seed
        chat_again = [replay_requests(p, CHAT, rng, next(ids)) for _ in range(4)]
        assert statistics.fmean(r.rate for r in chat_again) > 0.95 * plain, seed
        assert p.num_explorations > 0 and p._own == {} and p._exploring == {} and p._explored == {}, seed

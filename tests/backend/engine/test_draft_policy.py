"""The adaptive draft length (backend/engine/speculative/policy.py): its cost model against a hand count, the
choices it makes at low and high load, and exactness in the engine whatever k it picks per step."""

from __future__ import annotations

import itertools
import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import backend.engine.speculative.load_rates as load_rates
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from backend.engine.speculative.policy import (
    DRAFT_STEP_GUESS,
    EWMA_WEIGHT,
    MIN_RATE_SAMPLES,
    PRIOR_ACCEPTANCE,
    PROBE_EVERY,
    PROBE_SHARE,
    REPROBE_EVERY,
    SPEC_PROBE_STEPS,
    STARVED_RUN,
    DraftPolicy,
    StepLoad,
    load_bucket,
)
from backend.models.loader import load_model
from tests.backend.engine.test_speculative import OracleDrafts, engine_for, prompts
from tests.backend.engine_helpers import Result, collect, request, run_all
from tests.backend.speculative_toy import MarkovModel
from tests.backend.tiny_checkpoints import add_mtp_layers, make_tiny


def policy(k: int = 3, acceptance: float | None = None, **kw: Any) -> DraftPolicy:
    p = DraftPolicy(
        k, saturation_rows=kw.pop("saturation_rows", 64), draft_cost=kw.pop("draft_cost", 0.25), **kw
    )
    if acceptance is not None:
        p.acceptance = [acceptance] * k
    return p


def test_cost_model_by_hand() -> None:
    p = policy(3, saturation_rows=8, draft_cost=0.5)
    p.acceptance = [0.8, 0.5, 0.25]
    assert p.expected_tokens(0) == 1.0
    assert p.expected_tokens(3) == pytest.approx(1 + 0.8 + 0.4 + 0.1)
    load = StepLoad(num_rows=4, num_drafting=4)
    # k = 2: verify 4 + 8 = 12 rows (1.5 units); depth 1 over 4 · 2.2 = 8.8 rows (1.1), depth 2 over 4 (1)
    assert p.step_cost(load, 2) == pytest.approx(1.5 + 0.5 * (1.1 + 1.0))
    assert p.rate(load, 2) == pytest.approx(4 * 2.2 / (1.5 + 0.5 * 2.1))
    assert p.step_cost(load, 0) == 1.0 and p.rate(load, 0) == 4.0


def test_rates_in_one_pass_equal_the_model_exactly() -> None:
    """`rates` (what `choose` asks before every step) gives `rate(load, k)` for every k, equal
    floats: it is the same arithmetic, not an approximation, so the choices are unchanged."""
    rng = torch.Generator().manual_seed(5)
    for _ in range(200):
        K = int(torch.randint(1, 6, (1,), generator=rng))
        p = policy(K, saturation_rows=int(torch.randint(1, 128, (1,), generator=rng)))
        p.draft_cost = float(torch.rand(1, generator=rng))
        p.acceptance = torch.rand(K, generator=rng, dtype=torch.float64).tolist()
        rows, drafting, others = (int(x) for x in torch.randint(0, 300, (3,), generator=rng))
        load = StepLoad(num_rows=rows + drafting + others, num_drafting=drafting, num_other_samples=others)
        assert p.rates(load, p.acceptance) == [p.rate(load, k) for k in range(K + 1)]


def test_one_user_with_good_acceptance_drafts_the_most() -> None:
    p = policy(3, acceptance=0.8)
    assert p.choose(StepLoad(num_rows=1, num_drafting=1)) == 3
    assert p.last_k == 3


@pytest.mark.parametrize("batch", [64, 128])
def test_high_concurrency_turns_drafting_off(batch: int) -> None:
    """Past the rows where a forward saturates, drafting loses even with every draft accepted."""
    p = policy(3, acceptance=1.0)
    assert p.choose(StepLoad(num_rows=batch, num_drafting=batch)) == 0
    assert [p.choose(StepLoad(num_rows=b, num_drafting=b)) for b in (1, 8, 16)] == [3, 3, 3]
    assert p.choose(StepLoad(num_rows=32, num_drafting=32)) in (1, 2)  # in between: shorter drafts


def test_the_draft_length_falls_with_load() -> None:
    p = policy(3, acceptance=0.85)
    ks = [p.choose(StepLoad(num_rows=b, num_drafting=b)) for b in range(1, 129)]
    assert ks[0] == 3 and ks[-1] == 0
    assert all(a >= b for a, b in itertools.pairwise(ks)), ks


def test_acceptance_is_measured_per_depth() -> None:
    p = policy(3)
    assert p.acceptance == [PRIOR_ACCEPTANCE] * 3
    for _ in range(400):
        p.observe(3, 0)  # depth 1 rejected: depths 2 and 3 never judged
    assert p.acceptance[0] < 0.01 and p.acceptance[1:] == [PRIOR_ACCEPTANCE] * 2
    for _ in range(400):
        p.observe(2, 2)  # both judged, both accepted
    assert p.acceptance[0] > 0.99 and p.acceptance[1] > 0.99 and p.acceptance[2] == PRIOR_ACCEPTANCE
    assert p.acceptance_length == pytest.approx(1 + p.acceptance[0] * (1 + p.acceptance[1] * (1 + 0.8)))


def test_plain_steps_told_at_once_update_the_policy_as_one_at_a_time() -> None:
    """A plain decode stream's steps are told in runs (`observe_plain`, decoder.py `settle`): the
    policy ends exactly as when each was told by `observe_step` in turn, a cold step and an unmeasured
    load (a neighbour's bound) among them."""
    steps = [(1, 1e-3), (1, 1.1e-3), (1, 9e-3), (1, 0.0), (1, 0.95e-3), (2, 2e-3)] * 3
    one, many = (policy(3, draft_cost=0.5) for _ in range(2))
    for p in (one, many):
        p.is_calibrated = True
        p.observe_step(2, False, False, 2, 1e-3)  # a neighbour's plain steps: load 1's first bound
    for tokens, seconds in steps:
        one.observe_step(4, False, False, tokens, seconds)
    many.observe_plain(4, steps[:7])
    many.observe_plain(4, steps[7:])
    for p in (one, many):  # a load whose steps all measured nothing: no entry
        p.observe_step(64, False, False, 1, 0.0)
    many.observe_plain(64, [(1, 0.0), (1, -1.0)])
    assert one._rates == many._rates and one._rates[4].num_plain == 12  # not the cold ones, nor 0 s
    assert 64 not in many._rates


def test_poor_acceptance_turns_drafting_off_but_probes() -> None:
    p = policy(3, acceptance=0.02, draft_cost=0.5)
    load = StepLoad(num_rows=1, num_drafting=1)
    ks = [p.choose(load) for _ in range(3 * PROBE_EVERY)]
    # every PROBE_EVERY starved steps a run of STARVED_RUN one-draft steps (its verifies measure)
    starts = [PROBE_EVERY - 1, 2 * PROBE_EVERY - 1 + STARVED_RUN - 1]  # the run counts once
    assert [i for i, k in enumerate(ks) if k] == [s + j for s in starts for j in range(STARVED_RUN)]
    assert set(ks) == {0, 1}
    # a plain decode stream asks once every few steps (decoder.py `PLAIN_REASK`), each choice standing
    # for its steps: the starved probes come after as many steps as when asked every step
    held = policy(3, acceptance=0.02, draft_cost=0.5)
    asks = [held.choose(load, num_steps=8) for _ in range(3 * PROBE_EVERY // 8)]
    assert asks == [0, 1] + [1] * (STARVED_RUN - 1) + [0]  # the run: drafting steps, asked each step
    # load, not acceptance, keeps it off: no probes
    busy = policy(3, acceptance=0.02, draft_cost=0.5)
    assert not any(busy.choose(StepLoad(num_rows=256, num_drafting=256)) for _ in range(3 * PROBE_EVERY))


def test_draft_cost_is_measured_from_step_times() -> None:
    """Verify forwards of 10 ms per cost unit, draft forwards of 4 ms each (one row: 1 unit): m
    converges to 0.4, and with it drafting turns off for one user whose drafts are rarely right."""
    p = policy(3, acceptance=0.8, draft_cost=0.05, is_calibrated=True)
    for _ in range(200):
        p.observe_timing(0.010, 4, 3 * 0.004, [1, 1, 1])
    assert p.draft_cost == pytest.approx(0.4, rel=1e-3)
    p.observe_timing(0.040, 128, 0.008, [128])  # 128 rows: 2 units each; 20 ms a unit, drafts 4 ms
    assert p.draft_cost == pytest.approx(0.4 + 0.1 * (0.2 - 0.4), rel=1e-3)
    p.acceptance = [0.3] * 3  # E(1) = 1.3 < the 1 + m a draft costs
    assert p.choose(StepLoad(num_rows=1, num_drafting=1)) == 0
    fixed = policy(3, draft_cost=0.05)  # a configured m is not measured
    fixed.observe_timing(0.010, 4, 0.012, [1, 1, 1])
    assert fixed.draft_cost == 0.05


def engine_steps(p: DraftPolicy, num_steps: int, accepted: int = 2) -> list[int]:
    """`num_steps` of one user observed as the engine observes them: a plain step (0.5 ms); a
    drafting step after a plain one catches up and proposes (3 ms, `observe_catch_up`); later ones
    verify (`accepted` of k drafts, 1 ms + 0.1 ms a draft: `observe`, `observe_step` and
    `observe_timing`, a sample of m ~0.1). The draft lengths."""
    load, ks, last = StepLoad(num_rows=1, num_drafting=1), [], 0
    for _ in range(num_steps):
        k = p.choose(load)
        if k and not last:
            p.observe_catch_up(1, 0.003)
        elif k:
            n = min(accepted, k)
            p.observe(k, n)
            p.observe_step(1, True, True, n + 1, 0.001 + 0.0001 * k)
            p.observe_timing(0.001, 1 + k, 0.0001 * k, [1] * k)
        else:
            p.observe_step(1, False, False, 1, 0.0005)
        ks.append(k)
        last = k
    return ks


def test_cold_samples_neither_stick_nor_end_drafting() -> None:
    """Draft forwards that compiled their kernels (1 s against a 1 ms verify: samples of m ~1,000)
    move m 2.5x each at most; four leave no draft length paying at one user even with every draft
    accepted, yet starved probes (runs of STARVED_RUN drafting steps) verify, their steady samples
    bring m back down, and drafting (3 tokens a 1.3 ms verifying step against a plain step's one
    in 0.5 ms) takes over again."""
    p = policy(3, acceptance=0.9, draft_cost=0.25, is_calibrated=True)
    p.observe_timing(0.001, 4, 1.0, [1])
    assert p.draft_cost == pytest.approx(0.25 + 0.1 * (16 * 0.25 - 0.25))
    for _ in range(3):
        p.observe_timing(0.001, 4, 1.0, [1])
    assert p.draft_cost > 5 and not p._would_pay_if_accepted(StepLoad(num_rows=1, num_drafting=1))
    ks = engine_steps(p, 4000)
    assert p.draft_cost < 0.25  # measured again by the probes' verifies
    assert sum(1 for k in ks[-500:] if k) > 0.9 * 500  # drafting pays and runs
    # a cold drafting step (0.5 s where steps take ~1 ms) is not a rate: drafting keeps winning
    p.observe_step(1, True, True, 1, 0.5)
    assert all(engine_steps(p, 50)[-40:])


@pytest.fixture
def quick_probes(monkeypatch: pytest.MonkeyPatch) -> None:
    """A probe as soon as the plain steps have taken as long as it is expected to (short requests)."""
    monkeypatch.setattr(load_rates, "PROBE_SHARE", 1.0)  # `LoadRates.can_afford_probe`


@pytest.mark.usefixtures("quick_probes")
def test_engine_measures_its_draft_cost() -> None:
    """Drafts made to cost 5 ms more each than the toy's verify: m climbs from its start, and the
    draft length falls from K. The engine drafts K every step while it measures (a fixed policy): the
    adaptive one stops drafting once its measured step costs say drafting loses, after a timing-
    dependent handful of samples, and m is only timed on drafting steps."""
    engine = toy(3, speculative_draft_cost=None)
    model: Any = engine.runner.model
    forward_mtp = model.forward_mtp

    def slow(*args: Any) -> Any:
        time.sleep(0.005)
        return forward_mtp(*args)

    model.forward_mtp = slow
    spec = engine.spec
    assert spec is not None and spec.policy.is_calibrated and spec.policy.draft_cost == 1.0  # no layers: 1
    spec.is_greedy_enabled = False  # m is timed between the forwards of the host path's steps
    spec.policy.draft_cost = 0.01
    spec.policy.is_adaptive = False  # K drafts every step: each one a sample of m
    spec.max_drafting_seqs = spec.policy.max_paying_seqs(spec.max_seqs)
    got = run_all(engine, [request("a", [1], max_tokens=40)])
    assert spec.policy.draft_cost > 0.3  # each draft forward far slower than the verify
    spec.policy.is_adaptive = True
    assert spec.policy.choose(StepLoad(num_rows=1, num_drafting=1)) < 3
    plain = run_all(toy(0), [request("a", [1], max_tokens=40)])
    assert got["a"].token_ids == plain["a"].token_ids


def drive(
    p: DraftPolicy, steps: int, plain_rate: float, spec_rate: float, num_seqs: int = 1, tokens: int = 3
) -> list[int]:
    """`steps` decisions at one load, each step reported at the rate its kind is made to have (a
    drafting step right after a plain one only proposes: one token per sequence, as the engine)."""
    load, ks, last = StepLoad(num_rows=num_seqs, num_drafting=num_seqs), [], 0
    for _ in range(steps):
        k = p.choose(load)
        n = tokens * num_seqs if k and last else num_seqs
        p.observe_step(num_seqs, bool(k), bool(k and last), n, n / (spec_rate if k else plain_rate))
        ks.append(k)
        last = k
    return ks


def test_measured_rates_gate_drafting() -> None:
    """With m measured, a load runs MIN_RATE_SAMPLES plain steps, then (the prior, the cost model,
    says drafting pays) probes drafting ones, then keeps the side measured faster: where drafting
    wins, one plain step every REPROBE_EVERY refreshes the plain rate; where it loses, later probes
    wait until they fit in PROBE_SHARE of the plain time."""
    wins = policy(3, acceptance=0.9, is_calibrated=True)
    ks = drive(
        wins, MIN_RATE_SAMPLES + SPEC_PROBE_STEPS + REPROBE_EVERY + 2, plain_rate=100.0, spec_rate=250.0
    )
    first = ks.index(3)
    assert first == MIN_RATE_SAMPLES  # plain first: the rate drafting is compared with
    assert all(ks[first : first + SPEC_PROBE_STEPS])  # the probe
    steady = ks[first + SPEC_PROBE_STEPS :]
    assert steady.count(0) == 1 and all(steady[: REPROBE_EVERY - 1])  # one plain step refreshes its rate
    assert wins.num_probes == 1

    loses = policy(3, acceptance=0.9, is_calibrated=True)
    ks = drive(loses, 3000, plain_rate=100.0, spec_rate=60.0)  # a verifying step: 3 / 60 s, 5 plain ones
    assert ks[: MIN_RATE_SAMPLES + SPEC_PROBE_STEPS] == [0] * MIN_RATE_SAMPLES + [3] * SPEC_PROBE_STEPS
    probe_s = (1 + 3 * (SPEC_PROBE_STEPS - 1)) / 60.0  # the first drafting step only proposes
    # a later probe (4 drafting steps, each measured at 3.3 plain ones) waits for 263 plain steps
    assert ks[MIN_RATE_SAMPLES + SPEC_PROBE_STEPS :][:250] == [0] * 250
    assert loses.num_probes >= 2  # it does look again
    assert (loses.num_probes - 1) * probe_s <= PROBE_SHARE * ks.count(0) / 100.0  # after the prior's
    assert sum(1 for k in ks if k) == SPEC_PROBE_STEPS * loses.num_probes

    # loads are measured apart: one user's drafting does not decide 64 users'
    assert load_bucket(1) == 1 and load_bucket(3) == 4 and load_bucket(64) == 64 and load_bucket(65) == 128
    assert wins.choose(StepLoad(num_rows=64, num_drafting=64)) in (0, wins.last_k)
    fixed = policy(3, acceptance=0.9)  # a configured m: the cost model alone decides
    assert drive(fixed, 5, plain_rate=100.0, spec_rate=1.0) == [3] * 5


def burst(
    p: DraftPolicy, lengths: list[int], plain_s: float, draft_s: float, *, cap: int
) -> tuple[float, int]:
    """One burst of requests started together (the bench's c = 64 part), each finished after its
    `lengths` tokens, through the policy as the engine asks it (nothing past `cap` sequences); a
    verifying step emits 2.5 tokens per sequence. (seconds, drafting steps)."""
    left, seconds, num_drafting, last = [float(n) for n in lengths], 0.0, 0, 0
    while left:
        B = len(left)
        k = p.choose(StepLoad(num_rows=B, num_drafting=B)) if cap >= B else 0
        n = 2.5 if k and last else 1.0
        step_s = draft_s if k else plain_s
        p.observe_step(B, bool(k), bool(k and last), int(n * B), step_s)
        seconds, num_drafting, last = seconds + step_s, num_drafting + bool(k), k
        left = [x - n for x in left if x - n > 0]
    return seconds, num_drafting


def test_bursts_where_drafting_loses_cost_at_most_the_probe_share() -> None:
    """64 short requests at once, again and again (a drafting step costs 8 plain ones: it loses at
    every load): the bursts take at most PROBE_SHARE longer than plain decoding's and almost every
    step is the plain one. (The gate of 2026-12-04 probed each load after 3 plain steps and re-probed
    a load whose probe measured too few steps, every burst: 0.5x plain throughput on the H200.)"""
    rng = torch.Generator().manual_seed(0)
    lengths = torch.randint(4, 40, (64,), generator=rng).tolist()
    p = policy(3, acceptance=0.8, is_calibrated=True)
    cap = p.max_paying_seqs(64)
    assert 16 <= cap < 64  # the cost model: no draft length pays near 64 sequences
    plain, _ = burst(policy(3, is_calibrated=True), lengths, 0.0015, 0.012, cap=0)
    runs = [burst(p, lengths, 0.0015, 0.012, cap=cap) for _ in range(100)]
    assert sum(s for s, _ in runs) <= (1 + PROBE_SHARE) * 100 * plain
    assert p.num_probes >= 1 and sum(n for _, n in runs) <= 0.01 * 100 * 40


def test_catch_up_steps_are_paid_from_the_probe_budget() -> None:
    """Where drafting loses, each probe's first step also catches up the MTP KV of the positions
    plain steps computed (a prefill; here 20 plain steps' time): it stays out of the drafting step's
    measured cost, and later probes wait until probes and their catch-ups together fit in
    PROBE_SHARE of the plain time."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    load = StepLoad(num_rows=8, num_drafting=8)
    plain_s, draft_s, catch_up_s = 0.001, 0.003, 0.020  # a verifying step emits 1 token a sequence
    plain_total = probe_total = 0.0
    last = 0
    for _ in range(20_000):
        k = p.choose(load)
        if k and not last:  # the probe's first step: catches up, proposes
            p.observe_catch_up(8, catch_up_s)
            probe_total += catch_up_s
        elif k:
            p.observe_step(8, True, True, 8, draft_s)
            probe_total += draft_s
        else:
            p.observe_step(8, False, False, 8, plain_s)
            plain_total += plain_s
        last = k
    assert p._rates[8].draft_step_s == pytest.approx(draft_s)  # no catch-up in it
    first = catch_up_s + (SPEC_PROBE_STEPS - 1) * draft_s  # the prior's probe: not from the budget
    assert p.num_probes >= 3
    assert probe_total - first <= PROBE_SHARE * plain_total


def test_a_load_that_never_caught_up_prices_its_first_catch_up() -> None:
    """One user measured its catch-up (3 ms) and a drafting step at 4 plain ones (more than E(3)
    emits: no prior elsewhere). At 64 users a first probe would catch 64 sequences up: it is priced at
    64 x 1 ms (3 ms less the 2 ms drafting step a catch-up also is) beside its drafting steps, so it
    waits for ~1.5 s of plain steps there, not ~0.2 s (on the
    H100 such a probe, priced at its four drafting steps alone, took a third of a c=64 bench run)."""
    p = policy(3, acceptance=0.85, saturation_rows=512, is_calibrated=True)
    for _ in range(MIN_RATE_SAMPLES):
        p.observe_step(1, False, False, 1, 0.0005)
    p.observe_catch_up(1, 0.003)
    for _ in range(3):
        p.observe_step(1, True, True, 3, 0.002)
    load, plain_s = StepLoad(num_rows=64, num_drafting=64), 0.00073
    ks = []
    for _ in range(7000):
        k = p.choose(load)
        ks.append(k)
        if k:
            break
        p.observe_step(64, False, False, 64, plain_s)
    first = ks.index(next(k for k in ks if k)) if any(ks) else len(ks)
    # its four drafting steps at 4 plain ones, and 64 catch-ups of 1 ms (3 ms less a 2 ms drafting step)
    expected = (4 * 4 * plain_s + 64 * 0.001) / PROBE_SHARE / plain_s  # plain steps that pay for it
    assert 0.95 * expected <= first <= 1.05 * expected + MIN_RATE_SAMPLES


def test_a_cold_drafting_step_at_a_new_load_is_bounded_by_its_neighbour() -> None:
    """A probe begun at one user drafts on when a second request joins (bucket 2, no step of either
    kind measured there yet). That load's first drafting step compiled kernels (0.5 s against ~2 ms
    drafting steps next door): it is cold by the neighbour's bound, so it enters the estimate at that
    bound and is no rate; and a dear ratio measured far away (64 sequences) does not price a
    one-user probe once a load near it has measured its own."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    for _ in range(MIN_RATE_SAMPLES):
        p.observe_step(1, False, False, 1, 0.001)
    for _ in range(3):
        p.observe_step(1, True, True, 3, 0.002)
    p.observe_step(2, True, True, 2, 0.5)  # the new load's first drafting step: cold
    two = p._rates[2]
    assert two.draft_step_s == pytest.approx(0.002)  # the neighbour's estimate, not 0.5 s
    assert two.num_spec == 0  # not a rate
    assert p._rates.measured_draft_over_plain(2) == pytest.approx(2.0)  # load 1's, not 0.5 s over nothing

    for _ in range(MIN_RATE_SAMPLES):
        p.observe_step(64, False, False, 64, 0.001)
    for _ in range(3):
        p.observe_step(64, True, True, 64, 0.010)  # 10 plain steps a drafting step at 64 sequences
    assert p._rates.measured_draft_over_plain(1) == pytest.approx(2.0)  # its own load's
    assert p._rates.measured_draft_over_plain(32) == pytest.approx(10.0)  # 64's: within two doublings
    assert p._rates.measured_draft_over_plain(4) == pytest.approx(2.0)  # the nearer of 1 and 64
    assert p._rates.measured_draft_over_plain(8) == pytest.approx(10.0)  # none near: the dearest
    assert p._prior_pays(3, 1) and not p._prior_pays(3, 32)


def test_a_k_priced_dear_once_is_priced_again_when_its_measure_is_old() -> None:
    """One noisy verifying step of 3 drafts (10 plain steps) prices k = 3 dear; drafting goes on at
    k = 1 (1.5 plain steps a step). Once k = 3's entry is REPROBE_EVERY verifying steps old it is
    priced from k = 1's measure again (plus the starting m a depth), so it is tried and measured anew."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    load = StepLoad(num_rows=1, num_drafting=1)
    for _ in range(MIN_RATE_SAMPLES):
        p.observe_step(1, False, False, 1, 0.001)
    p.observe_step(1, True, True, 4, 0.010, 3)
    for _ in range(3):
        p.observe_step(1, True, True, 2, 0.0015, 1)
    costs = p._costs(load)
    assert costs is not None and costs[3] == pytest.approx(10.0) and costs[1] == pytest.approx(1.5)
    assert max(range(4), key=lambda k: p.rates(load, p.acceptance, measured=costs)[k]) == 1
    for _ in range(REPROBE_EVERY):
        p.observe_step(1, True, True, 2, 0.0015, 1)
    costs = p._costs(load)
    assert costs is not None and costs[3] == pytest.approx(1.5 + 2 * 0.25)  # k = 1's, plus m a depth
    assert max(range(4), key=lambda k: p.rates(load, p.acceptance, measured=costs)[k]) == 3


def test_drafting_starts_from_the_prior_and_measurements_take_over() -> None:
    """A fresh engine's first load: the prior (the cost model) says drafting pays, so it drafts
    after MIN_RATE_SAMPLES plain steps, not after the ~320 a probe budget of PROBE_SHARE would
    wait. Past the cost model's cap it never drafts. Once a drafting step has been measured to cost
    more plain steps than its tokens (4.9 against E(3) = 3.44), the prior at a new load says drafting
    does not pay: its probe waits for the budget."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    ks = drive(p, 40, plain_rate=100.0, spec_rate=250.0)
    assert ks.index(3) == MIN_RATE_SAMPLES and all(ks[MIN_RATE_SAMPLES:])  # within the first 4 steps
    budgeted = math.ceil(SPEC_PROBE_STEPS * DRAFT_STEP_GUESS / PROBE_SHARE)  # the old wait: 320 steps
    assert budgeted >= 300

    cap = p.max_paying_seqs(256)
    assert 0 < cap < 256
    above = policy(3, acceptance=0.9, is_calibrated=True)
    load = StepLoad(num_rows=cap + 1, num_drafting=cap + 1)
    assert all(above.choose(load) == 0 for _ in range(500))  # the cost model: no k pays here
    assert above.num_probes == 0

    loses = policy(3, acceptance=0.9, is_calibrated=True)
    ks = drive(loses, 60, plain_rate=100.0, spec_rate=40.0)  # load 1: drafting measured to lose
    assert ks.count(3) == SPEC_PROBE_STEPS and ks[-40:] == [0] * 40  # probed once, then plain
    assert loses.expected_tokens(3) == pytest.approx(3.439)
    ks = drive(loses, 300, plain_rate=200.0, spec_rate=80.0, num_seqs=2)  # a new load (bucket 2)
    assert ks == [0] * 300 and loses.num_probes == 1  # its prior does not pay: no free probe
    assert loses.choose(StepLoad(num_rows=1, num_drafting=1)) == 0


def test_one_user_drafts_where_it_wins() -> None:
    """One long request (drafting steps 1.5 plain ones, 2.5 tokens each): after its probe almost
    every step drafts."""
    p = policy(3, acceptance=0.8, is_calibrated=True)
    _, num_drafting = burst(p, [3000], 0.001, 0.0015, cap=1)
    assert p.num_probes == 1 and num_drafting * 2.5 > 0.85 * 3000


def test_a_cap_from_the_cost_model() -> None:
    """`max_paying_seqs`: the largest load where some k beats plain decoding with every draft
    accepted; loads past it never do, whatever the acceptance."""
    p = policy(3, acceptance=0.3)
    cap = p.max_paying_seqs(256)
    perfect = policy(3, acceptance=1.0)
    paying = [b for b in range(1, 257) if perfect.choose(StepLoad(num_rows=b, num_drafting=b))]
    assert paying == list(range(1, cap + 1))
    assert p.max_paying_seqs(8) == 8  # within a smaller limit
    assert policy(3, draft_cost=1.0).max_paying_seqs(64) == 0  # a draft as dear as the target: never


@pytest.mark.usefixtures("quick_probes")
def test_engine_turns_drafting_off_where_it_measures_slower() -> None:
    """A speculative step made 20 ms slower on the host (work the cost model does not price, and
    that leaves m, a ratio of forward times, low): after its probe the engine decodes plainly, and
    the output is plain decoding's."""
    engine = toy(3, speculative_draft_cost=None)
    spec = engine.spec
    assert spec is not None
    run = spec.run

    def slow(*args: Any) -> Any:
        time.sleep(0.02)
        return run(*args)

    spec.run = slow  # type: ignore[method-assign]
    spec.policy.draft_cost = 0.01  # the model's start: drafting pays
    spec.max_drafting_seqs = spec.policy.max_paying_seqs(spec.max_seqs)
    got = run_all(engine, [request("a", [1], max_tokens=60)])
    assert got["a"].token_ids == run_all(toy(0), [request("a", [1], max_tokens=60)])["a"].token_ids
    assert 0 < engine.stats.spec_verifies < SPEC_PROBE_STEPS * 2  # the probe, then plain steps
    assert spec.policy.choose(StepLoad(num_rows=1, num_drafting=1)) == 0


def test_fixed_policy_always_drafts_k() -> None:
    p = policy(2, acceptance=0.0, is_adaptive=False)
    assert p.choose(StepLoad(num_rows=512, num_drafting=512)) == 2
    assert p.choose(StepLoad(num_rows=0, num_drafting=0)) == 0  # nobody can draft


# ---- in the engine ------------------------------------------------------------------------------


def toy(k: int, **config: Any) -> Engine:
    V = 16
    target = torch.randn(V, V, generator=torch.Generator().manual_seed(0)) * 3
    values = dict(num_pages=512, page_size=4, max_num_batched_tokens=512, max_num_seqs=64)
    values |= dict(num_speculative_tokens=k, speculative_max_seqs=64, speculative_draft_cost=0.25) | config
    return Engine(MarkovModel(target, target), EngineConfig.build(**values), vocab_size=V, context_window=512)


def test_engine_drafts_k_for_one_user_and_none_for_many() -> None:
    one = toy(3)
    got = run_all(one, [request("a", [1], max_tokens=1 + 4 * 10)])  # the prefill's token, 10 verifies
    assert [len(o.token_ids) for o in got["a"].outputs if o.token_ids] == [1] + [4] * 10  # K + the bonus
    assert one.stats.spec_draft_length == 3 and one.stats.spec_verifies == 10
    a = 1 - (1 - PRIOR_ACCEPTANCE) * (1 - EWMA_WEIGHT) ** 10  # every depth accepted 10 times
    assert one.stats.spec_acceptance_length == pytest.approx(1 + a + a**2 + a**3)

    many = toy(3)
    reqs = [request(f"r{i}", [i % 16], max_tokens=8) for i in range(64)]
    got = run_all(many, reqs)
    plain = run_all(toy(0), reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert many.stats.spec_verifies == 0 and many.stats.spec_draft_length == 0
    assert many.runner.spec_forwards is not None


def test_speculative_and_plain_requests_share_one_forward() -> None:
    """A request with a grammar (never drafts) beside drafting ones: one verify forward holds them all."""
    from tests.backend.engine.test_engine import EvenTokensOnly

    engine = toy(2)
    model: Any = engine.runner.model
    seen: list[tuple[int, int]] = []
    forward_spec = model.forward_spec

    def recording(batch: Any) -> Any:
        seen.append((batch.num_seqs, batch.num_tokens))
        return forward_spec(batch)

    model.forward_spec = recording
    engine.add_request(request("c", [1], max_tokens=6, temperature=1.0, seed=3), constraint=EvenTokensOnly())
    engine.add_request(request("d1", [2], max_tokens=9))
    engine.add_request(request("d2", [3], max_tokens=9))
    results: dict[str, Result] = {}
    while engine.has_unfinished:
        collect(results, engine.step())
    # three sequences, the drafting two with 2 drafts each: 1 + 3 + 3 rows in one forward
    assert (3, 7) in seen
    assert all(len(o.token_ids) <= 1 for o in results["c"].outputs)


class ScriptedK:
    """The draft policy's choice replaced by a seeded random k in 0 … K per step (or `cycle`'s)."""

    def __init__(self, engine: Engine, seed: int = 0, cycle: list[int] | None = None) -> None:
        spec = engine.spec
        assert spec is not None
        self.rng = torch.Generator().manual_seed(seed)
        self.chosen: list[int] = []
        K = spec.K
        ks = itertools.cycle(cycle or [0])

        def choose(
            load: StepLoad, request_ids: tuple[str, ...] = (), is_starting: bool = True, num_steps: int = 1
        ) -> int:
            k = int(torch.randint(0, K + 1, (1,), generator=self.rng)) if cycle is None else next(ks)
            k = k if load.num_drafting else 0
            self.chosen.append(k)
            return k

        spec.policy.choose = choose  # type: ignore[method-assign]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("policy")
    return {
        arch: load_model(add_mtp_layers(make_tiny(arch, root / arch)), dtype=torch.float32, num_mtp_layers=1)
        for arch in ("deepseek_v3", "glm_moe_dsa")
    }


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm_moe_dsa"])
def test_greedy_identical_when_k_changes_every_step(tiny: dict[str, Any], arch: str) -> None:
    """k drawn anew each step (0 … 3; a step verifies a prefix of last step's drafts, or none):
    the outputs stay those of plain decoding, and no page leaks."""
    model = tiny[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=6 + i % 17, logprobs=True)
        for i, p in enumerate(prompts(12, model.config.vocab_size, seed=21))
    ]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3)
    OracleDrafts(engine, plain, p_wrong=0.2)
    scripted = ScriptedK(engine, seed=5)
    spec = run_all(engine, reqs)
    for r in reqs:
        assert spec[r.request_id].token_ids == plain[r.request_id].token_ids, r.request_id
        for a, b in zip(spec[r.request_id].logprobs, plain[r.request_id].logprobs, strict=True):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    assert set(scripted.chosen) == {0, 1, 2, 3}
    s = engine.stats
    assert s.spec_accepted_tokens > 0 and s.spec_verifies > 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


def test_adaptive_engine_is_exact_on_a_real_model(tmp_path: Path) -> None:
    """The policy's own choices (random MTP layer: acceptance falls, drafting goes off, probes)."""
    model = load_model(
        add_mtp_layers(make_tiny("deepseek_v3", tmp_path / "m")), dtype=torch.float32, num_mtp_layers=1
    )
    reqs = [
        request(f"r{i}", p, max_tokens=40) for i, p in enumerate(prompts(2, model.config.vocab_size, seed=3))
    ]
    plain = run_all(engine_for(model, 0), reqs)
    engine = engine_for(model, 3)
    got = run_all(engine, reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    assert engine.stats.spec_drafted_tokens > 0


def test_fresh_pages_carry_no_stale_draft_kv(tiny: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps without drafts write no MTP KV: a page's MTP slot is zeroed after the page is allocated
    and before any MTP layer runs, so a later draft never reads what an earlier owner left there
    (the target's slots untouched). Plain steps leave the clearing to the first step that drafts
    (backend/engine/speculative/forwards.py `defer_clear`): they launch nothing for the MTP layers."""
    model = tiny["deepseek_v3"]
    engine = engine_for(model, 2, max_num_batched_tokens=512)  # the plain steps' gap caught up, not given up
    # plain steps first (pages allocated; a plain stream asks every PLAIN_REASK steps), then a draft
    ScriptedK(engine, cycle=[0] * 4 + [2])
    kv = engine.runner.kv_cache
    mtp, target = kv.layers[-1], kv.layers[0]
    for cache in mtp.values():
        cache.fill_(7.0)  # an earlier owner's MTP KV
    bm = engine.block_manager
    seen: list[tuple[list[int], bool, bool, bool]] = []
    forward_mtp = engine.runner.model.forward_mtp

    def first_draft(*args: Any, **kw: Any) -> Any:
        if not seen:  # before any MTP layer has run: every page allocated so far, zeroed
            pages = [p for p in range(bm.num_pages) if bm.tags[p] > 0]  # tags start at 1
            others = [p for p in range(kv.num_pages) if p not in pages]
            seen.append(
                (
                    pages,
                    all(bool((c[pages] == 0).all()) for c in mtp.values()),
                    all(bool((c[others] == 7.0).all()) for c in mtp.values()),
                    all(bool(c[pages].abs().sum() > 0) for c in target.values()),
                )
            )
        return forward_mtp(*args, **kw)

    monkeypatch.setattr(engine.runner.model, "forward_mtp", first_draft)
    engine.add_request(request("r", prompts(1, model.config.vocab_size, seed=2)[0] * 3, max_tokens=24))
    assert engine.spec is not None
    engine.spec.policy.forced_k = 0  # a plain step (not one that fills the prompt's MTP KV)
    engine.step()  # the prompt, no drafts: its pages allocated by a plain step
    engine.spec.policy.forced_k = None
    assert engine.spec.k == 0 and not seen
    num_plain_pages = bm.num_pages - bm.num_available_pages
    while engine.has_unfinished:
        engine.step()
    (pages, is_zeroed, others_kept, target_written), *_ = seen
    assert len(pages) > num_plain_pages >= 3
    assert is_zeroed and others_kept and target_written


def test_a_sequence_catches_up_only_what_drafting_can_still_save_it() -> None:
    """After plain steps, a sequence's first drafting step catches up its MTP KV (its gap, the target
    recomputing it too). Before any catch-up is measured the cost model decides, per sequence, in
    plain steps: at E(3) = 3.44, 5 tokens left save 3.5 steps, more than a 100-position gap's share
    of a forward (1.56 x 1.25) but less than a 400-position one's (7.8); 100 tokens left save 71.
    Once drafting wins at 8 sequences (250 tokens/s against 100: 6 ms a token) and a catch-up has
    been measured (0.5 s for 800 positions, a drafting step's 0.096 s of it its own: 0.5 ms a
    position), seconds decide: 40 tokens left pay for 100 positions, 5 do not; a load two doublings
    away prices positions from this one."""
    p = policy(3, acceptance=0.9, is_calibrated=True)
    drive(p, MIN_RATE_SAMPLES + SPEC_PROBE_STEPS + 5, plain_rate=100.0, spec_rate=250.0, num_seqs=8)
    assert p._rates[8].is_winning and not p._rates[8].is_probing
    assert p.pays_to_catch_up(8, gap=100, tokens_left=5)  # the model: 3.5 > 1.95 plain steps
    assert not p.pays_to_catch_up(8, gap=400, tokens_left=5)  # 3.5 < 9.8
    assert p.pays_to_catch_up(8, gap=400, tokens_left=100)
    p.observe_catch_up(8, 0.5, gap_rows=800)
    assert p._rates[8].catch_up_row_s == pytest.approx((0.5 - p._rates[8].draft_step_s) / 800)
    assert p.pays_to_catch_up(8, gap=100, tokens_left=40)  # 0.24 s saved for 0.05 s
    assert not p.pays_to_catch_up(8, gap=100, tokens_left=5)  # 0.03 s for 0.05 s
    assert p.pays_to_catch_up(8, gap=0, tokens_left=1)  # nothing to catch up: nothing to price
    drive(p, MIN_RATE_SAMPLES + SPEC_PROBE_STEPS + 5, plain_rate=100.0, spec_rate=250.0, num_seqs=32)
    assert not p.pays_to_catch_up(32, gap=400, tokens_left=20)  # 0.12 s saved for 0.2 s
    assert p.pays_to_catch_up(32, gap=400, tokens_left=100)
    # one user, unmeasured: 50 positions behind, it drafts again unless it is about to finish
    fresh = policy(3, acceptance=0.9, is_calibrated=True)
    assert fresh.pays_to_catch_up(1, gap=50, tokens_left=100)
    assert not fresh.pays_to_catch_up(1, gap=50, tokens_left=1)  # 0.71 steps saved for 1.25
    assert policy(3, acceptance=0.9, is_adaptive=False).pays_to_catch_up(1, 50, 1)  # fixed: always


def test_sequences_near_their_end_stay_plain_after_plain_steps() -> None:
    """Plain steps (forced) leave every sequence behind; once drafting may start again, the sequences
    with few tokens left before max_tokens no longer draft (they would catch up more than drafting
    saves them), the others catch up and draft, and the outputs are plain decoding's."""
    engine = toy(3)
    assert engine.spec is not None
    reqs = [request(f"r{i}", [i % 16] * 200, max_tokens=(10 if i % 2 else 60)) for i in range(6)]
    for r in reqs:
        engine.add_request(r)
    results: dict[str, Result] = {}
    engine.spec.policy.forced_k = 0
    running = engine.scheduler.running
    while engine.scheduler.waiting or min(s.num_output_tokens for s in running) < 6:  # prompts, 6 tokens each
        collect(results, engine.step())
    engine.spec.policy.forced_k = None
    drafted: set[str] = set()
    drafting = engine.spec.drafting

    def spy(out: Any, num_requests: int) -> list[bool]:
        flags = drafting(out, num_requests)
        drafted.update(s.seq.request_id for s, f in zip(out.scheduled, flags, strict=True) if f)
        return flags

    engine.spec.drafting = spy  # type: ignore[method-assign]
    while engine.has_unfinished:
        collect(results, engine.step())
    # 4 tokens left save 2.6 plain steps (E(3) = 2.95 at the prior acceptance), less than 205 positions'
    # share of a forward (3.2 x 1.25); 54 left save 36
    assert {f"r{i}" for i in range(6) if i % 2} & drafted == set()
    assert {f"r{i}" for i in range(6) if not i % 2} <= drafted
    plain = run_all(toy(0), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_no_drafts_while_a_burst_is_still_being_admitted() -> None:
    """A burst of more requests than drafting pays for, admitted a few prompts a step (the token
    budget): no step drafts while requests wait, even when only a few run yet; once the burst has
    drained below the cap, the last ones draft, and the outputs are plain decoding's."""
    many = toy(3, max_num_batched_tokens=64)
    assert many.spec is not None
    cap = many.spec.max_drafting_seqs
    assert 4 <= cap < 64
    reqs = [request(f"r{i}", [i % 16] * 16, max_tokens=8 + 8 * (i % 12)) for i in range(cap + 8)]
    for r in reqs:
        many.add_request(r)
    waiting_when_drafting, first_steps_running = [], []
    while many.has_unfinished:
        many.step()
        if len(first_steps_running) < 3:
            first_steps_running.append(len(many.scheduler.running))
        if many.spec.k:
            waiting_when_drafting.append(len(many.scheduler.waiting))
    assert first_steps_running[0] < cap  # the burst's first steps run fewer than the cap
    assert waiting_when_drafting and not any(waiting_when_drafting)
    got = run_all(toy(3, max_num_batched_tokens=64), reqs)
    plain = run_all(toy(0, max_num_batched_tokens=64), reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}


def test_a_step_of_several_requests_is_priced_at_the_mean_of_their_expected_tokens() -> None:
    """A step emits the sum of each request's E(k): one request that accepts every draft beside one
    that accepts none emits (4 + 1) / 2 = 2.5 a request at k = 3, not E(3) at their mean acceptance
    (2.37 here, which kept mixed steps plain where they paid)."""
    p = DraftPolicy(3, saturation_rows=64, draft_cost=0.25, is_calibrated=True)
    for _ in range(200):
        p.observe(3, 3, "tool")
        p.observe(3, 0, "chat")
    each = [p.expected_tokens_at(p._step_acceptance((rid,))[0]) for rid in ("tool", "chat")]
    both, is_own = p._step_acceptance(("tool", "chat"))
    assert is_own and p.expected_tokens_at(both) == pytest.approx(sum(each) / 2)
    assert each[0] > 3.8 and each[1] < 1.1


def test_drafting_resumes_after_a_refresh_at_a_thin_gain() -> None:
    """A lone request drafting K at ~1.08x plain (measured step costs, its own acceptance) goes on
    drafting after the plain step a refresh takes every REPROBE_EVERY drafting steps: the start
    margin is for drafting that starts after plain steps, not for one measurement step (it once kept
    every later step plain)."""
    from backend.engine.speculative.policy import REPROBE_EVERY

    p = DraftPolicy(3, saturation_rows=64, draft_cost=0.25, is_calibrated=True)
    costs = {1: 10.0, 2: 10.0, 3: p.expected_tokens_at(p.recent) / 1.08}  # K at 1.08x plain
    p._costs = lambda load: costs  # type: ignore[method-assign]
    p._own["a"] = ([10] * 3, [round(10 * x) for x in p.recent])  # drafting already, its own verifies
    load = StepLoad(num_rows=1, num_drafting=1)
    ks = [p.choose(load, ("a",), is_starting=False) for _ in range(REPROBE_EVERY + 40)]
    assert ks.count(0) == 1 and ks.index(0) == REPROBE_EVERY - 1  # the refresh, then drafting again
    assert p.choose(load, ("a",), is_starting=True) == 0  # the same gain from plain steps: not started


def test_an_exploration_ended_early_is_not_judged() -> None:
    """An exploring request aborted after one verify leaves the exploration interval as it was (one
    verify is not a finding either way)."""
    from backend.engine.speculative.policy import EXPLORE_EVERY

    p = DraftPolicy(3, saturation_rows=64, draft_cost=0.25, is_calibrated=True)
    p._explored["x"] = False
    p.observe(3, 0, "x")
    p.forget("x")
    assert p.explore_every == EXPLORE_EVERY and p._explored == {} and p._own == {}

"""Speculative decoding starts serving with measured step costs (issue 28, "no loss at c=64").

The GPU warm-up times plain and drafting steps at every load the draft policy tells apart and the
policy keeps those seconds (not the acceptance: the warm-up's prompts are random), so a load is
priced from its first step there rather than probed: on the H100 a c = 64 burst of GLM nano
requests ran 0.73x speculation off, its passing loads probing (and compiling) drafting steps that
cost three plain ones. And a prompt joining a load where the measured costs say drafting does not
pay gets no MTP layer over its chunks (a fill step cost 1.5x its prefill on the H100).
"""

from __future__ import annotations

import itertools
import types
from typing import Any

import pytest

from backend.engine import engine as engine_module
from backend.engine.speculative import decoder as decoder_module
from backend.engine.speculative.load_rates import LoadRates
from backend.engine.speculative.policy import PRIOR_ACCEPTANCE, StepLoad
from backend.server.warmup import warm_up
from tests.backend.engine.test_draft_policy import policy, toy
from tests.backend.engine_helpers import Result, collect, request, run_all


def costs(plain_s: float, over_plain: dict[int, float]) -> LoadRates:
    """A load whose plain step took `plain_s` and a drafting step of k drafts `over_plain[k]` plain ones."""
    rates = LoadRates(plain=1.0 / plain_s, num_plain=3, plain_step_s=plain_s)
    rates.step_s_by_k = {k: (r * plain_s, 0) for k, r in over_plain.items()}
    rates.draft_step_s = max(rates.step_s_by_k.values())[0]
    return rates


@pytest.fixture(autouse=True)
def ticking_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's step timer reads a clock that ticks 0.5 ms a reading: a plain step (two
    readings) measures 0.5 ms, under the 1 ms the adopted costs below price it at, a drafting step
    1-2 ms (more readings). On the wall clock the measured steps of a loaded machine (a test run
    beside another) priced plain decoding dear and drafting won where it loses."""
    ticks = itertools.count()
    clock = types.SimpleNamespace(perf_counter=lambda: next(ticks) * 0.0005)
    monkeypatch.setattr(engine_module, "time", clock)
    monkeypatch.setattr(decoder_module, "time", clock)


CHEAP = {1: 1.3, 2: 1.5, 3: 1.7}  # a drafting step: E(3) ~2.95 at the prior acceptance beats it
DEAR = {1: 2.6, 2: 3.0, 3: 3.4}  # ... and loses to it


def test_adopted_step_costs_price_a_load_from_its_first_step() -> None:
    p = policy(3, is_calibrated=True)
    assert p.choose(StepLoad(num_rows=1, num_drafting=1)) == 0  # unmeasured: plain steps first
    p = policy(3, is_calibrated=True)
    p.adopt_step_costs({1: costs(0.001, CHEAP), 64: costs(0.002, DEAR)}, draft_cost=0.4)
    assert p.draft_cost == 0.4 and p.acceptance == [PRIOR_ACCEPTANCE] * 3
    assert p.choose(StepLoad(num_rows=1, num_drafting=1), ("a",)) == 3  # priced, not probed
    many = StepLoad(num_rows=64, num_drafting=64)
    assert [p.choose(many) for _ in range(40)] == [0] * 40 and p.num_probes == 0
    # a policy that does not measure (m configured) ignores them
    fixed = policy(3)
    fixed.adopt_step_costs({1: costs(0.001, CHEAP)}, draft_cost=0.4)
    assert fixed.draft_cost == 0.25 and not fixed._rates


def test_may_draft_where_unmeasured_winning_or_priced_to_pay() -> None:
    p = policy(3, is_calibrated=True)
    assert p.may_draft(64)  # nothing measured: its probe will tell
    p.adopt_step_costs({1: costs(0.001, CHEAP), 64: costs(0.002, DEAR)}, draft_cost=0.4)
    assert p.may_draft(1) and not p.may_draft(64) and not p.may_draft(40)
    assert p.may_draft(16)  # bucket 16: unmeasured
    p._rates.at(64).is_winning = True
    assert p.may_draft(64)
    p.forced_k = 0
    assert not p.may_draft(1)
    assert policy(3, is_calibrated=True, is_adaptive=False).may_draft(64)


def measuring(**config: Any) -> Any:
    """The toy engine with a measuring policy (m unset) that starts from m = 0.1 (the toy model has
    no layers to count: m would start at 1, where nothing pays)."""
    engine = toy(3, speculative_draft_cost=None, **config)
    spec = engine.spec
    assert spec is not None
    spec.policy.draft_cost = spec.policy.prior_draft_cost = 0.1
    spec.max_drafting_seqs = spec.policy.max_paying_seqs(spec.max_seqs)
    return engine


def fill_steps(engine: Any, n: int) -> tuple[int, int, int]:
    """`n` prompts of 40 tokens at once, decoded 12 tokens: the steps that ran the MTP layer over
    prompt chunks without drafting (`fills_draft_kv`; a drafting step writes their MTP KV too), the
    verifies, and the positions caught up (MTP KV a prefill left unwritten)."""
    spec = engine.spec
    for i in range(n):
        engine.add_request(request(f"r{i}", [(3 * i) % 15 + 1] * 40, max_tokens=12))
    fills = caught_up = 0
    while engine.has_unfinished:
        engine.step()
        fills += spec.fills_draft_kv
        caught_up += spec.num_gap_rows
    return fills, engine.stats.spec_verifies, caught_up


def test_prompts_joining_a_load_priced_to_lose_get_no_mtp_kv() -> None:
    """Eight prompts at once (one load bucket, 8): with costs there that say drafting loses, their
    prefill steps run no MTP layer and nothing drafts or probes; with costs that say it pays, their
    MTP KV is written as they prefill (drafting follows with nothing to catch up); the tokens are
    plain decoding's either way."""
    dear = measuring(max_num_batched_tokens=256)
    dear.spec.policy.adopt_step_costs({8: costs(0.001, DEAR)}, draft_cost=0.4)
    assert fill_steps(dear, 8) == (0, 0, 0) and dear.spec.policy.num_probes == 0
    cheap = measuring(max_num_batched_tokens=256)
    cheap.spec.policy.adopt_step_costs({8: costs(0.001, CHEAP)}, draft_cost=0.4)
    _, verifies, caught_up = fill_steps(cheap, 8)
    assert verifies > 0 and caught_up == 0
    reqs = [request(f"r{i}", [(3 * i) % 15 + 1] * 40, max_tokens=12) for i in range(8)]
    plain = run_all(toy(0, max_num_batched_tokens=256), reqs)
    for engine in (dear, cheap):
        again = run_all(engine, reqs)
        assert {k: v.token_ids for k, v in again.items()} == {k: v.token_ids for k, v in plain.items()}


def test_a_prompt_too_long_to_catch_up_later_is_filled_whatever_the_load() -> None:
    """A 60-token prompt beside seven short ones, a step budget of 64 (a gap over 32 is given up):
    at a load priced to lose it is filled all the same, or its MTP KV would be a hole for good and,
    once alone, it would draft over it (found by a review of the fill gate)."""
    engine = measuring(max_num_batched_tokens=64)
    spec = engine.spec
    spec.policy.adopt_step_costs({1: costs(0.001, CHEAP), 8: costs(0.001, DEAR)}, draft_cost=0.4)
    reqs = [request(f"s{i}", [(3 * i) % 15 + 1] * 8, max_tokens=3) for i in range(7)]
    reqs.append(request("L", [7, 3, 9, 1] * 15, max_tokens=40))
    for r in reqs:
        engine.add_request(r)
    long_seq = engine._seqs["L"]
    results: dict[str, Result] = {}
    fills = 0
    while engine.has_unfinished:
        collect(results, engine.step())
        fills += spec.fills_draft_kv
    assert fills >= 1 and not spec.book.has_hole(long_seq)
    assert long_seq.num_whole_draft_kv_tokens == long_seq.num_draft_kv_tokens
    assert engine.stats.spec_verifies > 0
    plain = run_all(toy(0, max_num_batched_tokens=64), reqs)
    assert {k: v.token_ids for k, v in results.items()} == {k: v.token_ids for k, v in plain.items()}


def test_a_step_that_drafts_nothing_ends_the_probe_its_choice_began() -> None:
    """Four sequences behind (plain steps), drafting priced cheap at their load: the policy begins a
    probe and chooses k > 0, but every catch-up is refused, so nothing drafts. The probe ends there;
    left open, it made a later lone request draft K on every step whatever its own pricing said."""
    meh = {1: 2.0, 2: 2.4, 3: 2.7}  # alone, k = 3 beats plain by ~9%: under START_MARGIN
    engine = measuring(max_num_batched_tokens=512)
    spec = engine.spec
    p = spec.policy
    p.adopt_step_costs({1: costs(0.001, meh)}, draft_cost=0.4)
    for i in range(4):
        engine.add_request(request(f"r{i}", [i + 1] * 20, max_tokens=200))
    results: dict[str, Result] = {}
    p.forced_k = 0
    for _ in range(8):  # the prompts and plain decodes: load 4 has its plain rate, every sequence behind
        collect(results, engine.step())
    p.forced_k = None
    p._rates.at(4).draft_step_s = 1.5 * p._rates.at(4).plain_step_s  # the prior says a probe pays
    p.pays_to_catch_up = lambda *args: False  # type: ignore[method-assign]
    ks = []
    for _ in range(13):
        collect(results, engine.step())
        ks.append(spec.k)
    assert p.num_probes == 1 and p._probe_left == 0 and set(ks) == {0} and p.last_k == 0
    for i in range(4):
        engine.abort(f"r{i}")
    collect(results, engine.step())
    engine.add_request(request("x", [5, 9, 2, 11] * 3, max_tokens=30))
    alone = []
    while engine.has_unfinished:
        collect(results, engine.step())
        alone.append(spec.k)
    assert set(alone) == {0}  # priced at its own acceptance and START_MARGIN: plain


def test_the_warm_up_keeps_no_catch_up_price() -> None:
    """The timed pass's one catch-up at a load runs before any drafting step there: its seconds,
    whole, would price each caught-up position several times too dear. Not adopted."""
    rates = costs(0.001, CHEAP)
    rates.catch_up_s, rates.catch_up_row_s = 0.01, 1e-5
    kept = rates.step_costs()
    assert kept.catch_up_s == 0 and kept.catch_up_row_s == 0 and kept.step_s_by_k


def test_the_full_warm_up_times_every_load_and_draft_length() -> None:
    """A measuring policy's warm-up leaves each load bucket up to the draft cap with a plain step's
    seconds and every draft length's, nothing of what the random prompts emitted or accepted, no
    probe, an empty pool; later outputs are plain decoding's."""
    engine = measuring(max_num_seqs=16, speculative_max_seqs=16)
    spec = engine.spec
    assert spec.max_drafting_seqs == 16
    warm_up(engine, is_full=True)
    p = spec.policy
    assert p.forced_k is None and p.acceptance == [PRIOR_ACCEPTANCE] * 3 and p.num_probes == 0
    assert sorted(p._rates) == [1, 2, 4, 8, 16]
    for rates in p._rates.values():
        assert rates.plain_step_s > 0 and rates.num_plain > 0 and rates.draft_step_s > 0
        assert set(rates.step_s_by_k) == {1, 2, 3} and all(at == 0 for _, at in rates.step_s_by_k.values())
        assert rates.num_spec == 0 and rates.spec == 0 and not rates.is_probing and not rates.is_winning
    assert p._costs(StepLoad(num_rows=16, num_drafting=16)) is not None
    load = engine.load()
    assert (load.running, load.waiting, load.free_pages) == (0, 0, load.total_pages)
    reqs = [request(f"r{i}", [i % 16] * 5, max_tokens=20) for i in range(6)]
    got, plain = run_all(engine, reqs), run_all(toy(0), reqs)
    assert {k: v.token_ids for k, v in got.items()} == {k: v.token_ids for k, v in plain.items()}
    # a configured m: nothing to calibrate, nothing kept
    fixed = toy(3)
    warm_up(fixed, is_full=True)
    assert fixed.spec is not None and not fixed.spec.policy._rates


def test_the_warm_up_times_only_loads_whose_prompts_and_verifies_fit_one_step() -> None:
    """With a budget of 64 tokens, 16-token prompts fit one step for 4 requests at most: larger
    loads would run the pattern half-prefilled (steps of a few verifying sequences priced as all of
    them), so they are left to serving's own measurements."""
    engine = measuring(max_num_seqs=16, speculative_max_seqs=16, max_num_batched_tokens=64)
    warm_up(engine, is_full=True)
    assert sorted(engine.spec.policy._rates) == [1, 2, 4]

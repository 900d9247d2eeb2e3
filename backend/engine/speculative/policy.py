"""How many tokens to draft in a step: speculative decoding's draft length, adapted to load.

Each step the engine picks one draft length k in 0 … K (`--speculative mtp:K`) for every drafting
sequence, the k that maximises the tokens the step emits per unit of its cost:

    tokens(k) = N + B·E(k)             E(k) = 1 + Σ_{i=1..k} Π_{j≤i} a_j   (E(0) = 1)
    cost(k)   = c(R + B·k) + m·(c(B·E(k)) + (k − 1)·c(B))      (the second term only for k ≥ 1)
    c(rows)   = max(1, rows / R_sat)

B sequences could draft, N other sequences sample a token anyway, R is the step's rows without drafts
(every scheduled token). a_j is the measured probability that draft j is accepted when drafts
1 … j−1 were (an EWMA over verify steps, per depth), so E(k) is the expected tokens a verify of k
drafts emits, the bonus token included. `c(rows)` is a forward's cost in units of a plain decode step:
flat while the step is bound by reading the weights (and by launches), growing linearly with its
rows once they saturate the device's compute (`R_sat`, `EngineConfig.speculative_saturation_rows`).
The verify forward runs R + B·k rows. The drafts cost `m` (`speculative_draft_cost`: one MTP forward
against one target forward) per depth: depth 1 runs over each sequence's accepted positions (E(k)
rows), depths 2 … k over one row each. Past the batch where R + B·k crosses R_sat the verify's
cost grows with k faster than E(k) does, and k = 0 (no drafts: the plain, graph-replayed decode
step) wins: that is "off past the concurrency where it stops paying".

Acceptance is only measured while drafting, so when low acceptance (not load) turns drafting off,
every `PROBE_EVERY`-th such step starts `STARVED_RUN` steps that draft one token anyway, to notice
when acceptance comes back.

`m` is measured too when the configuration leaves it unset (`is_calibrated`): each speculative step
reports how long its verify (planning, forward, acceptance) and its draft forwards took, and their
sizes in cost units (c of each forward's rows); (draft seconds per unit) / (verify seconds per unit)
is a sample of m (EWMA). On a device where the draft forwards cost more than the model says (eager
launches, host work between them), m grows and drafting turns off at lower load, or at any load.

The model prices forwards, not what a drafting step costs whatever its k: the verify graph's and
the MTP layer's launches over the draft rows, acceptance, the host's planning. Measured, that is a
large part of a small model's drafting step (H100, 2026-12-06, GLM nano tool calls: ~1.9 plain steps
at k = 1, ~2.2 at k = 3, where the model with its measured m of 0.37 said 1.37 and 2.11), and left
out it makes k = 1 look cheap: the adaptive policy drafted one token a step and ran 0.99x where
three drafts a step ran 1.52x. So each verifying step's seconds, over the load's plain step, less
the model's cost of its k, is a sample of a load's `overhead` (EWMA, at least 0), which every k >= 1
pays in the rates the draft length is chosen by; and once a load has measured verifying steps of a
k (`step_s_by_k`), every k there is priced from the measured seconds over the load's plain step (a
measured k as measured, the others on the line through the measured ones: `_costs`), so a wrong
slope m (measured on the host path, where drafts run eagerly) cannot hold the choice at a short k
the measurements say is slower.

The model prices forwards, not the host work around them, and a speculative step has more of that
than a plain one (planning the verify rows, accepting, the draft depths' plans). So when `m` is
measured, the choice is also checked against measured throughput: per load (the step's sequences,
rounded up to a power of two), the engine reports every decode-only step's tokens and seconds
(`observe_step`), plain steps and steps that verified drafts kept apart (plain: an EWMA of tokens
per second; drafting: tokens over seconds of the recent verifying steps, `SPEC_RATE_WEIGHT`). A load
with no plain measurement runs plain steps first, then probes drafting: it drafts until it has
measured `probe_verifies` verifying steps (`PROBE_VERIFIES` sequences' verifies, at least
`MIN_RATE_SAMPLES` steps: one user's tokens per verify range over 1 … K + 1, a batch's vary less; the
first drafting step only proposes, and prefill steps are not measured), or only `MIN_RATE_SAMPLES`
where they measured under `CLEAR_LOSS` of the plain rate. Each probe measures afresh. Where it
measured drafting at least as fast as plain steps, the load drafts until its drafting rate falls
`RATE_MARGIN` below the plain one: a few poor verifies in a row are not a loss. (Before 2026-12-05 a
probe measured 3 verifies and an EWMA of each step's rate, weighted 0.2, decided every step: at one
user on the H100, where drafting K every step ran 1.07-1.28x on tool calls, it drafted in ~3% of
the steps and ran 0.89-0.94x; tests/backend/engine/test_draft_policy_replay.py replays that.)
A load's first probe starts from a prior: where it says drafting pays (the cost model chose
k > 0, and E(k) beats a drafting step's cost in plain steps as measured at the nearest load within
`NEAR_DOUBLINGS` doublings of its sequences, else at the dearest load measured: none measured
yet, the cost model alone) the probe begins right after those `MIN_RATE_SAMPLES` plain steps, so
drafting starts within a load's first few steps; then the measured rates decide. Where drafting
wins, every `REPROBE_EVERY` drafting steps one plain step refreshes the rate it is compared with.
Where it loses (or its probe measured too little), or where the prior says it does not pay, it is
probed only once the plain steps at that load have taken `1 / PROBE_SHARE` times what the probe is
expected to cost (`probe_verifies` + 1 drafting steps at their measured seconds there): at 64
sequences a drafting step can cost ten plain ones, and a load seen for a few dozen steps (a burst of short requests) must not pay
for probes it cannot amortize. Such a probe is priced from a drafting step (in plain steps) as
measured nearby (else at the dearest load), or `DRAFT_STEP_GUESS` before any. A probe's first step also catches up
the MTP KV of the positions plain steps computed (backend/engine/speculative/book.py), a prefill:
that step stays out of the rates and of m, and is charged to the load's probe budget
(`observe_catch_up`); a load that has never caught up prices its first probe's catch-up ahead, at the
dearest catch-up per sequence measured at any load (less a drafting step's cost there) times its
sequences.

Acceptance is a request's as much as a load's: tool calls copy their arguments (E(3) ~3 on the nano
models), chat does not (~2), so one shared estimate and one verdict per load, both measured over
whatever ran before, kept one kind of request from drafting after another kind lost (H100, 2026-12-06:
Kimi tool calls 0.93x plain after its chat runs, where drafted they ran 1.15x). So the engine names the
requests that could draft (`choose(load, request_ids)`, at most `OWN_MAX_SEQS`; more: the shared
estimate, whose mean theirs would be), and a step is priced at the mean of their E(k), each request's
its own verifies over `OWN_PRIOR_WEIGHT` pseudo-verifies at the recent requests' (`recent`: each
finished request's own, `RECENT_WEIGHT`). Once the load has measured step costs (`_costs`) that price
decides, the load's measured verdict not asked (a plain refresh every `REPROBE_EVERY` drafting steps
kept; drafting that would start after plain steps, not after a refresh, starts only `START_MARGIN`
above plain steps' rate); and one in `EXPLORE_EVERY` new lone requests that it keeps plain (one in up
to `EXPLORE_MAX_EVERY` while explorations find no gain) drafts K for `OWN_VERIFIES` verifies anyway,
where K drafts all accepted would pay, to measure its own (`_explores`): a request that never drafts
never shows that its kind has changed.

Past `max_paying_seqs` (the most sequences at which the cost model, with every draft accepted and
the starting m, lets any k pay) the engine does not ask: those steps are plain, with no probe
(backend/engine/speculative/decoder.py `drafting`).

A fresh engine's first drafting steps compile kernels: a step over `COLD_RATIO` times its kind's
estimate at its load (a load with none yet: a neighbour's, as above) is cold, not a rate (its seconds enter the estimate at that bound), and a
sample of m enters at most `M_SAMPLE_RATIO` times m. Acceptance-starved probing asks whether drafting
could pay at the smaller of the measured and the starting m, since m is only measured by drafting:
a high m must not end its own measurement (on the H100 in 2026-12, a warm-up's compiles measured m at
27.8, after which no draft length paid and nothing drafted again: speedup_c1 0.96x where drafting K
every step ran 1.22-1.33x).

Any k is exact: a step verifies a prefix of the drafts proposed the step before (k may shrink), and
proposes k for the next (backend/engine/speculative/decoder.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from backend.engine.speculative.load_rates import (
    COLD_RATIO,
    DRAFT_STEP_GUESS,
    MIN_RATE_SAMPLES,
    PROBE_SHARE,
    PROBE_VERIFIES,
    LoadRates,
    Loads,
    ewma,
    load_bucket,
    probe_verifies,
)

PRIOR_ACCEPTANCE = 0.8  # before any verify: optimistic, so that drafting starts and gets measured
EWMA_WEIGHT = 0.05  # per observed draft: ~20 verifies of a depth make its estimate
PROBE_EVERY = 16
# a starved probe drafts this many steps in a row: the first after plain ones only proposes (and
# catches up), the rest verify, so acceptance (and m) are measured again; one lone drafting step
# measured neither (it proposed, and the plain steps after it threw its drafts away)
STARVED_RUN = 4
TIMING_WEIGHT = 0.1  # per timed step
SPEC_PROBE_STEPS = PROBE_VERIFIES + 1  # one user's probe: the first drafting step verifies nothing
RATE_MARGIN = 0.1  # drafting that won its probe stops once measured this far below plain steps
# drafting steps at a load where drafting wins, between plain refreshes: a refresh costs a plain
# step and then a drafting one that only proposes (host path, several ms on the H200 in 2026-12)
REPROBE_EVERY = 256
M_SAMPLE_RATIO = 16.0  # a sample of m enters at most this many times m: m grows 2.5x a sample at most
OVERHEAD_WEIGHT = 0.1  # per verifying step, in a load's measured overhead of a drafting step
# per-request acceptance (`_step_acceptance`): a request's own verifies of a depth, over this many
# pseudo-verifies at the recent requests' acceptance; steps of more drafting requests than
# OWN_MAX_SEQS use the shared estimate (their mean would be it, at O(B) host work a step)
OWN_PRIOR_WEIGHT = 4.0
OWN_MAX_SEQS = 8
RECENT_WEIGHT = 0.5  # per finished request with verifies, in the recent requests' acceptance
RECENT_TRIALS = 8  # a depth's verifies of a request that weigh RECENT_WEIGHT (fewer: less)
OWN_VERIFIES = 3  # verifies an exploring request makes (`_explores`)
EXPLORE_EVERY = 4  # of the new requests the model would keep plain, one drafts to measure its own
EXPLORE_MAX_EVERY = 8  # ... or fewer, down to one in this many, while explorations find no gain
# drafting after a plain step starts only where its rate beats plain steps' by this much: its first
# step only proposes (H100, 2026-12-06: Kimi chat priced ~1.05x plain ran 0.82x, drafting a few
# steps of every request)
START_MARGIN = 0.15


@dataclass(frozen=True, slots=True)
class StepLoad:
    """What a step holds before any draft: its rows, its sequences that could draft, the others
    that sample a token anyway."""

    num_rows: int
    num_drafting: int
    num_other_samples: int = 0


class DraftPolicy:
    """Per step, the draft length (`choose`); after a verify, the acceptance it saw (`observe`)."""

    def __init__(
        self,
        max_drafts: int,
        *,
        saturation_rows: int,
        draft_cost: float,
        is_adaptive: bool = True,
        is_calibrated: bool = False,
    ) -> None:
        """`draft_cost`: m, or its starting value when `is_calibrated` (measured from step times)."""
        self.max_drafts = max_drafts
        self.saturation_rows = saturation_rows
        self.draft_cost = draft_cost
        self.prior_draft_cost = draft_cost  # m before any measurement
        self.is_adaptive = is_adaptive
        self.is_calibrated = is_calibrated
        self.acceptance = [PRIOR_ACCEPTANCE] * max_drafts  # a_1 … a_K
        self.last_k = 0  # the draft length the last drafting-capable step chose
        self.forced_k: int | None = None  # set: every step drafts this many, nothing measured or gated
        self._num_starved = 0  # steps in a row that acceptance alone kept from drafting
        self._starved_left = 0  # steps left of a starved probe's run of drafting steps
        self._rates = Loads()  # load bucket -> measured rates (`observe_step`)
        self._probe_left = 0  # drafting steps a probe of the speculative rate may still take
        self._probe_bucket = 0  # the load it measures
        self.num_probes = 0  # probes of the speculative rate begun (any load)
        self._pays_if_accepted: dict[tuple[StepLoad, float], bool] = {}  # `_would_pay_if_accepted`
        # per request: its own verifies of each depth and the accepted ones (`observe`), the
        # acceptance of the recent requests (`forget`), and the exploring requests (`_explores`)
        self._own: dict[str, tuple[list[int], list[int]]] = {}
        self.recent = list(self.acceptance)
        self.explore_every = EXPLORE_EVERY  # doubles after each exploration that found no gain
        self._until_explore = EXPLORE_EVERY  # new requests kept plain until the next explores
        self._seen: set[str] = set()  # new requests counted towards `_until_explore`
        self._exploring: dict[str, int] = {}  # request id -> drafting steps left of its exploration
        self._explored: dict[str, bool] = {}  # request id -> it drafted after its exploration
        self._is_refreshed = False  # the last step was a refresh's plain one (`_refresh`)
        self.num_explorations = 0

    # ---- the model ---------------------------------------------------------------------------
    def expected_tokens(self, k: int) -> float:
        """E(k): tokens a verify of k drafts emits, expected under the measured acceptance."""
        return self.expected_tokens_at(self.acceptance[:k])

    @property
    def acceptance_length(self) -> float:
        """E(K): the expected tokens per verify step at the longest draft."""
        return self.expected_tokens(self.max_drafts)

    def forward_cost(self, num_rows: float) -> float:
        return max(1.0, num_rows / self.saturation_rows)

    def step_cost(self, load: StepLoad, k: int) -> float:
        B = load.num_drafting
        cost = self.forward_cost(load.num_rows + B * k)
        if k:
            drafts = self.forward_cost(B * self.expected_tokens(k)) + (k - 1) * self.forward_cost(B)
            cost += self.draft_cost * drafts
        return cost

    def rate(self, load: StepLoad, k: int) -> float:
        """Tokens emitted per unit of cost with k drafts."""
        tokens = load.num_other_samples + load.num_drafting * self.expected_tokens(k)
        return tokens / self.step_cost(load, k)

    def rates(
        self,
        load: StepLoad,
        acceptance: list[float],
        m: float | None = None,
        overhead: float = 0.0,
        measured: dict[int, float] | None = None,
    ) -> list[float]:
        """`rate(load, k)` for k = 0 … K under `acceptance` (a_1 … a_K), in one pass: the same
        arithmetic in the same order (equal floats), without ~8 calls per k. It runs before every
        step, plain ones included: as calls it was 15 µs a step, 3% of a nano model's 0.44 ms.
        `overhead`: plain steps every drafting step costs beyond the model (a load's measured one);
        `measured`: a drafting step's cost in plain steps for every k 1 … K (`_costs`), in place of
        the model's and the overhead."""
        B, N, R, sat = load.num_drafting, load.num_other_samples, load.num_rows, self.saturation_rows
        m = self.draft_cost if m is None else m
        one_row = max(1.0, B / sat)  # forward_cost(B): a chained depth
        # measured costs are in plain steps at this load, so k = 0 costs one (not R / sat model units)
        out = [(N + B * 1.0) / (1.0 if measured is not None else max(1.0, R / sat))]
        total, p = 1.0, 1.0
        for k in range(1, self.max_drafts + 1):
            p *= acceptance[k - 1]
            total += p  # E(k)
            if measured is not None:  # `_costs`: every k priced
                out.append((N + B * total) / measured[k])
                continue
            cost = max(1.0, (R + B * k) / sat)
            cost += m * (max(1.0, B * total / sat) + (k - 1) * one_row)
            out.append((N + B * total) / (cost + overhead))
        return out

    # ---- per step ----------------------------------------------------------------------------
    def choose(
        self, load: StepLoad, request_ids: tuple[str, ...] = (), is_starting: bool = True, num_steps: int = 1
    ) -> int:
        """The draft length for this step (0: no drafts). `request_ids`: the requests that could
        draft (`load.num_drafting` of them), whose own acceptance prices the step (the module doc:
        per-request acceptance); none given: the shared estimate, measured gate and all.
        `is_starting`: none of them has drafts from the last step (drafting would start here).
        `num_steps`: the steps this choice stands for, where a plain decode stream asks once in a
        while (backend/engine/speculative/decoder.py `PLAIN_REASK`): acceptance-starved probing
        counts them as asked."""
        if load.num_drafting == 0:
            return 0
        if self.forced_k is not None:  # the warm-up's sweep of every draft length (backend/server/warmup.py)
            self.last_k = self.forced_k
            return self.forced_k
        if not self.is_adaptive:
            self.last_k = self.max_drafts
            return self.max_drafts
        costs = self._costs(load)
        acceptance, is_own = self._step_acceptance(request_ids)
        rates = self.rates(load, acceptance, overhead=self._overhead(load), measured=costs)
        k = max(range(len(rates)), key=lambda i: (rates[i], -i))  # ties: the shorter draft
        if is_own and costs is not None and self._probe_left == 0:
            # its requests' acceptance at this load's measured step costs decides: the load's
            # measured verdict came from whatever requests ran before (a plain refresh kept)
            is_refreshed, self._is_refreshed = self._is_refreshed, False
            if k and is_starting and not is_refreshed and rates[k] < (1 + START_MARGIN) * rates[0]:
                k = 0  # starting costs a step that only proposes (and a catch-up): a thin gain does not pay it
            is_exploring = k == 0 and self._explores(request_ids, costs)
            if k and len(request_ids) == 1 and request_ids[0] in self._explored:
                self._explored[request_ids[0]] = True  # its own acceptance says drafting pays
            k = self.max_drafts if is_exploring else self._refresh(load, k)
            self._num_starved = self._starved_left = 0
            self.last_k = k
            return k
        is_modelled = k > 0  # the cost model, at the measured acceptance, says k pays
        if k == 0 and self._starved_left > 0:  # a starved probe's run: verifies, not one lone proposal
            self._starved_left -= 1
            k = 1
        elif k == 0 and self._would_pay_if_accepted(load, min(self.draft_cost, self.prior_draft_cost)):
            self._num_starved += num_steps
            if self._num_starved // PROBE_EVERY != (self._num_starved - num_steps) // PROBE_EVERY:
                k = 1  # low acceptance (or a high m), not load, keeps drafting off: measure it again
                self._starved_left = STARVED_RUN - 1
        else:
            self._num_starved = self._starved_left = 0
        if self.is_calibrated and (k or self._probe_left > 0):  # a probe under way drafts to its end
            k = self._measured_gate(load, k or 1, is_modelled)
        self.last_k = k
        return k

    def _step_acceptance(self, request_ids: tuple[str, ...]) -> tuple[list[float], bool]:
        """The acceptance a step of `request_ids` drafts at, and whether it is theirs: the one whose
        E(k) is the mean of theirs (a step emits the sum of each request's E(k), not E(k) at their
        mean acceptance), each request's per depth its own verifies with `OWN_PRIOR_WEIGHT`
        pseudo-verifies at the recent requests' acceptance. None given, or more than `OWN_MAX_SEQS`:
        the shared estimate."""
        if not request_ids or len(request_ids) > OWN_MAX_SEQS:
            return self.acceptance, False
        K, w = self.max_drafts, OWN_PRIOR_WEIGHT
        reach = [0.0] * K  # the mean over the requests of P(draft j accepted) = a_1 ... a_j
        for rid in request_ids:
            own, p = self._own.get(rid), 1.0
            for j in range(K):
                p *= self.recent[j] if own is None else (w * self.recent[j] + own[1][j]) / (w + own[0][j])
                reach[j] += p
        # back to per-depth acceptance: E(k) = 1 + reach_1 + ... + reach_k, so a_j = reach_j / reach_{j-1}
        out, last = [], float(len(request_ids))
        for r in reach:
            out.append(r / last if last > 0 else 0.0)
            last = r
        return out, True

    def _explores(self, request_ids: tuple[str, ...], costs: dict[int, float]) -> bool:
        """A lone request the model keeps plain drafts K to measure its own acceptance, for its first
        `OWN_VERIFIES` verifies (one drafting step more: the first only proposes), if K drafts all
        accepted would beat a plain step at this load's measured costs: every `explore_every`-th new
        such request (`EXPLORE_EVERY`, doubling up to `EXPLORE_MAX_EVERY` while the explored ones do
        not go on drafting: each costs a few drafting steps, ~9% of Kimi nano's chat on the H100 at
        one in four). The recent requests' acceptance is only measured while they draft: one kind
        of request after another (chat, then tool calls) would otherwise never draft again."""
        if len(request_ids) != 1:
            return False
        rid = request_ids[0]
        left = self._exploring.get(rid)
        if left is None:
            if rid in self._seen or rid in self._own:
                return False
            self._seen.add(rid)
            if len(self._seen) > 4096:
                self._seen.clear()
            self._until_explore -= 1
            if self._until_explore > 0 or self.max_drafts + 1 <= costs[self.max_drafts]:
                return False
            self._until_explore = self.explore_every
            left = 2 * (OWN_VERIFIES + 1)  # a cap: it ends at OWN_VERIFIES verifies (asks may be discarded)
            self._explored[rid] = False
            self.num_explorations += 1
        own = self._own.get(rid)
        if left <= 0 or (own is not None and own[0][0] >= OWN_VERIFIES):
            self._exploring.pop(rid, None)
            return False
        self._exploring[rid] = left - 1
        return True

    def _own_tokens(self, trials: list[int], hits: list[int]) -> float:
        """E(K) at a request's own acceptance (its verifies alone; a depth it never reached: 0)."""
        return self.expected_tokens_at([h / t if t else 0.0 for t, h in zip(trials, hits, strict=True)])

    def expected_tokens_at(self, acceptance: list[float]) -> float:
        """E(K) at `acceptance` (a_1 … a_K)."""
        total, p = 1.0, 1.0
        for a in acceptance:
            p *= a
            total += p
        return total

    def _refresh(self, load: StepLoad, k: int) -> int:
        """k, but every `REPROBE_EVERY`-th drafting step at this load a plain one, which refreshes
        the plain step's seconds the measured costs are relative to."""
        if not k:
            return 0
        rates = self._rates.at(load_bucket(load.num_drafting + load.num_other_samples))
        rates.since_refresh += 1
        if rates.since_refresh >= REPROBE_EVERY:
            rates.since_refresh = 0
            self._is_refreshed = True  # the next step resumes drafting without `START_MARGIN`
            return 0
        return k

    def forget(self, request_id: str) -> None:
        """`request_id` finished: its own acceptance joins the recent requests' (`RECENT_WEIGHT`)."""
        own = self._own.pop(request_id, None)
        self._exploring.pop(request_id, None)
        self._seen.discard(request_id)
        explored = self._explored.pop(request_id, None)
        if own is None:
            return
        trials, hits = own
        # an exploration that measured what it set out to (an abort may end one early: not judged)
        # found a gain if it drafted on, or accepted well above the recent requests
        if explored is not None and (explored or trials[0] >= OWN_VERIFIES):
            recent = self.expected_tokens_at(self.recent)
            found = explored or self._own_tokens(trials, hits) > (1 + START_MARGIN) * recent
            self.explore_every = EXPLORE_EVERY if found else min(2 * self.explore_every, EXPLORE_MAX_EVERY)
        for j in range(self.max_drafts):
            if trials[j]:  # a few verifies move it less than a request's worth
                weight = RECENT_WEIGHT * min(1.0, trials[j] / RECENT_TRIALS)
                self.recent[j] += weight * (hits[j] / trials[j] - self.recent[j])

    def _overhead(self, load: StepLoad) -> float:
        """The plain steps a drafting step at `load` costs beyond the cost model, as measured there
        or at the nearest load within `NEAR_DOUBLINGS` (0: none measured, or not calibrated)."""
        if not self.is_calibrated:
            return 0.0
        bucket = load_bucket(load.num_drafting + load.num_other_samples)
        own = self._rates.get(bucket)
        if own is not None and own.num_overhead:  # the common case, before every step: no search
            return own.overhead
        near = self._rates.near(bucket, lambda r: r.num_overhead > 0)
        return near.overhead if near is not None else 0.0

    def _costs(self, load: StepLoad) -> dict[int, float] | None:
        """A drafting step's cost in plain steps for every k at this load once one k has been
        measured there (its own load: seconds differ between loads; None: none, or not calibrated):
        a measured k at its measured cost; another on the line through the cheapest and the dearest
        measured k (its slope at least 0), or, with one k measured, at that k's cost plus the
        model's per-depth cost at the lesser of the measured and the starting m for each depth
        more or fewer (optimistic, so that an unmeasured k gets tried and measured)."""
        if not self.is_calibrated:
            return None
        rates = self._rates.get(load_bucket(load.num_drafting + load.num_other_samples))
        if rates is None or not rates.step_s_by_k or not rates.plain_step_s:
            return None
        # fresh only: a k priced dear (one noisy step can) and so never chosen again falls back to
        # the line or the model once its entry is REPROBE_EVERY verifying steps old, and is tried again
        got = {
            k: s / rates.plain_step_s
            for k, (s, at) in rates.step_s_by_k.items()
            if rates.num_verifying - at <= REPROBE_EVERY
        }
        if not got:
            return None
        lo, hi = min(got), max(got)
        if hi > lo:
            slope = max(0.0, (got[hi] - got[lo]) / (hi - lo))
        else:
            slope = min(self.draft_cost, self.prior_draft_cost) * self.forward_cost(load.num_drafting)
        for k in range(1, self.max_drafts + 1):
            if k not in got:
                base = lo if k < lo else hi
                got[k] = max(got[base] + slope * (k - base), 1.0)
        return got

    def _measured_gate(self, load: StepLoad, k: int, is_modelled: bool) -> int:
        """k, or 0 where plain steps have been measured to emit more tokens per second at this load
        (or a probe of drafting there would cost more than `PROBE_SHARE` of its plain time, unless
        it is the load's first and the prior says drafting pays)."""
        bucket = load_bucket(load.num_drafting + load.num_other_samples)
        rates = self._rates.at(bucket)
        num_verifies = probe_verifies(bucket)
        if self._probe_left > 0:  # a probe drafts until its load has measured enough
            is_measuring = rates.num_spec < num_verifies and not rates.has_clearly_lost()
            if bucket != self._probe_bucket or is_measuring:
                self._probe_left -= 1
                return k
            self._probe_left = 0
        if rates.is_probing:  # its verdict: measured (not only begun) and at least as fast
            rates.is_probing = False
            rates.is_winning = rates.num_spec >= MIN_RATE_SAMPLES and rates.spec >= rates.plain
        elif rates.is_winning and rates.spec < (1 - RATE_MARGIN) * rates.plain:
            rates.is_winning = False  # slower by more than a run of short verifies explains
        if rates.num_plain < MIN_RATE_SAMPLES:
            return 0
        if not rates.is_winning:  # unmeasured, or losing
            is_prior = rates.num_probes == 0 and is_modelled and self._prior_pays(k, bucket)
            num_steps = num_verifies + 1  # the first drafting step after plain ones only proposes
            if not is_prior:
                # a load that measured its drafting steps and has not saved their cost: refused
                # without the estimates borrowed from other loads (a plain step asks every time)
                if PROBE_SHARE * rates.plain_s_since_probe < num_steps * rates.draft_step_s:
                    return 0
                catch_up_s = self._rates.catch_up_guess(bucket, rates)
                over_plain = self._rates.draft_over_plain(bucket)
                if not rates.can_afford_probe(num_steps, over_plain, catch_up_s):
                    return 0
            rates.begin_probe()
            self.num_probes += 1
            self._probe_left = 2 * num_steps  # at most: steps that verify nothing (prefills) too
            self._probe_bucket = bucket
            return k
        rates.since_refresh += 1
        if rates.since_refresh >= REPROBE_EVERY:  # drafting wins: one plain step refreshes its rival
            rates.since_refresh = 0
            return 0
        return k

    def _prior_pays(self, k: int, bucket: int) -> bool:
        """A verify of k drafts is expected to emit more tokens than a drafting step costs plain
        steps, as measured at or near `bucket` (else at the dearest load; before any measurement:
        the cost model's word)."""
        measured = self._rates.measured_draft_over_plain(bucket)
        return not measured or self.expected_tokens(k) > measured

    def observe_step(
        self,
        num_seqs: int,
        is_drafting: bool,
        is_verified: bool,
        num_tokens: int,
        seconds: float,
        num_drafts: int = 0,
        num_drafting: int | None = None,
    ) -> None:
        """A decode-only step of `num_seqs` sequences emitted `num_tokens` in `seconds`: plain, or
        drafting (`is_drafting`, `num_drafts` a sequence, `num_drafting` of the sequences: all when
        None) and verifying drafts (`is_verified`; a drafting step that only proposed counts towards
        the cost of probes, not towards the rates, nor the overhead). The rates compare what the load
        emitted either way; a k's measured cost and the overhead (priced for every sequence drafting)
        come only from steps where every sequence drafted: one of eight drafting costs a step about
        what eight do for an eighth of the tokens, and priced as eight it made drafting look dear."""
        if not self.is_calibrated or seconds <= 0:
            return
        bucket = load_bucket(num_seqs)
        rates = self._rates.at(bucket)
        limit = rates.cold_limit(is_drafting)
        if math.isinf(limit):  # none of its kind here yet: a neighbour's bound (a probe that moved here)
            near = self._rates.near(bucket, lambda r: r.plain_step_s > 0)
            limit = near.cold_limit(is_drafting) if near is not None else limit
        # an estimate grows 1.6x a step at most; a cold first drafting step enters at the guess
        first_cold = is_drafting and not rates.draft_step_s and seconds > limit
        rates.add_seconds(is_drafting, min(seconds, limit / COLD_RATIO if first_cold else limit))
        if seconds > limit:  # cold (kernels compiled, the host stalled): not a rate the next steps run at
            return
        if is_verified:
            rates.add_spec(num_tokens, seconds)
            if num_drafts and rates.plain_step_s and (num_drafting is None or num_drafting == num_seqs):
                load = StepLoad(num_rows=num_seqs, num_drafting=num_seqs)
                beyond = max(0.0, seconds / rates.plain_step_s - self.step_cost(load, num_drafts))
                rates.overhead += (beyond - rates.overhead) * (OVERHEAD_WEIGHT if rates.num_overhead else 1.0)
                rates.num_overhead += 1
                s, _ = rates.step_s_by_k.get(num_drafts, (0.0, 0))
                rates.step_s_by_k[num_drafts] = (ewma(s, seconds), rates.num_verifying)
            rates.num_verifying += 1
        elif not is_drafting:
            rates.add_plain(num_tokens / seconds)

    def observe_plain(self, num_seqs: int, steps: list[tuple[int, float]]) -> None:
        """`observe_step` of plain decode steps of `num_seqs` sequences, each (tokens, seconds), in
        their order: the same updates, the load looked up once (a plain decode stream's
        measurements are told a few at a time: backend/engine/speculative/decoder.py `settle`)."""
        if not self.is_calibrated:
            return
        bucket = load_bucket(num_seqs)
        rates = None  # looked up at the first step measured (none: no entry made, as observe_step)
        for num_tokens, seconds in steps:
            if seconds <= 0:
                continue
            if rates is None:
                rates = self._rates.at(bucket)
            limit = rates.cold_limit(False)
            if math.isinf(limit):
                near = self._rates.near(bucket, lambda r: r.plain_step_s > 0)
                limit = near.cold_limit(False) if near is not None else limit
            rates.add_seconds(False, min(seconds, limit))
            if seconds <= limit:
                rates.add_plain(num_tokens / seconds)

    def pays_to_catch_up(self, num_seqs: int, gap: int, tokens_left: int) -> bool:
        """Whether a sequence that plain steps left `gap` positions behind (MTP KV its first drafting
        step must catch up, the target recomputing them too) should draft again, given the
        `tokens_left` it may still emit, in a step of `num_seqs` sequences. Measured (its load drafts
        faster than plain steps run, and a catch-up's seconds a position is known here or within
        `NEAR_DOUBLINGS`): what drafting saves over those tokens at the measured rates beats the
        catch-up's seconds. Else (drafting not measured faster here: a probe, or a winning load's
        rate within `RATE_MARGIN` below the plain one, where the measured saving would be nothing
        and one refresh step would stop every sequence drafting) the cost model, in plain steps: the
        steps drafting K saves it, tokens_left (1 - 1/E(K)) with each drafting step priced as one
        plain step (optimistic), beat its share of a forward over the gaps in the target and the MTP
        layer, max(gap / R_sat, 1 / num_seqs) (1 + m). The engine asks on every step that would draft
        (backend/engine/speculative/decoder.py): the rates and the load change. On the H100 (2026-12-06) a
        burst of 64 nano requests drafted once 51 were left, each with ~10 tokens to go: its
        catch-up was a second prefill of every prompt (0.78x plain steps); then its last 2-4
        sequences still drafted and finished before a verify (40-90 ms of a 0.14 s run)."""
        if not self.is_adaptive or not gap:
            return True
        bucket = load_bucket(num_seqs)
        rates = self._rates.get(bucket)
        if self.is_calibrated and rates is not None and rates.plain and rates.spec > rates.plain:
            near = self._rates.near(bucket, lambda r: r.catch_up_row_s > 0)
            if near is not None:
                return (
                    tokens_left * max(0.0, 1.0 / rates.plain - 1.0 / rates.spec) > near.catch_up_row_s * gap
                )
        steps_saved = tokens_left * (1.0 - 1.0 / self.expected_tokens(self.max_drafts))
        return steps_saved > max(gap / self.saturation_rows, 1.0 / max(num_seqs, 1)) * (1.0 + self.draft_cost)

    def observe_catch_up(self, num_seqs: int, seconds: float, gap_rows: int = 0) -> None:
        """A decode-only step of `num_seqs` sequences that began drafting again took `seconds`,
        most of them catching up MTP KV (a prefill of the positions plain steps computed: backend/
        engine/speculative/book.py). Not a drafting step's cost (kept out of the rates and of
        `draft_step_s`), but paid from the load's probe budget: the next probe waits until plain
        steps have run `1 / PROBE_SHARE` times as long again."""
        if not self.is_calibrated or seconds <= 0:
            return
        rates = self._rates.at(load_bucket(num_seqs))
        bound = COLD_RATIO * DRAFT_STEP_GUESS * rates.plain_step_s * num_seqs or math.inf
        if seconds <= bound:  # a cold one (kernels compiled) is not what the next will cost
            rates.catch_up_s = ewma(rates.catch_up_s, seconds)
            # a drafting step's own seconds off: what its positions cost. Only from gaps past the
            # saturation rows: below them a forward costs the same whatever its rows, and a refresh's
            # one-position gaps divided a step's fixed excess by a handful of rows (far too dear)
            if gap_rows >= self.saturation_rows:
                row_s = max(0.0, seconds - rates.draft_step_s) / gap_rows
                rates.catch_up_row_s = ewma(rates.catch_up_row_s, row_s)
        rates.plain_s_since_probe -= min(seconds, bound) / PROBE_SHARE

    def observe_timing(
        self, verify_s: float, verify_rows: int, draft_s: float, draft_rows: list[int]
    ) -> None:
        """A speculative step's verify took `verify_s` over `verify_rows` rows, its draft forwards
        `draft_s` over `draft_rows` rows each: a sample of m, when it is measured."""
        if not self.is_calibrated or verify_s <= 0 or not draft_rows:
            return
        unit_s = verify_s / self.forward_cost(verify_rows)
        sample = draft_s / unit_s / sum(self.forward_cost(n) for n in draft_rows)
        sample = min(sample, M_SAMPLE_RATIO * self.draft_cost)
        self.draft_cost += TIMING_WEIGHT * (sample - self.draft_cost)

    def observe(self, num_drafts: int, num_accepted: int, request_id: str | None = None) -> None:
        """One sequence's verify: of `num_drafts` drafts, the first `num_accepted` were accepted
        (`request_id`'s: its own acceptance too)."""
        own = None
        if request_id is not None:
            own = self._own.get(request_id)
            if own is None:
                own = self._own[request_id] = ([0] * self.max_drafts, [0] * self.max_drafts)
        for j in range(min(num_accepted + 1, num_drafts)):  # depths whose draft was judged
            hit = 1.0 if j < num_accepted else 0.0
            self.acceptance[j] += EWMA_WEIGHT * (hit - self.acceptance[j])
            if own is not None:
                own[0][j] += 1
                own[1][j] += j < num_accepted

    def drafted_nothing(self) -> None:
        """The step `choose` gave k > 0 drafted nothing (every sequence's catch-up refused, or no
        room): a plain step. A probe that choice began ends unmeasured: left open, it sent the next
        load that asked down the probe path (drafting k there whatever its own pricing said)."""
        self.last_k = 0
        if self._probe_left > 0:
            self._probe_left = 0
            rates = self._rates.get(self._probe_bucket)
            if rates is not None:
                rates.is_probing = False

    def step_costs(self) -> tuple[dict[int, LoadRates], float]:
        """What the steps measured so far cost, per load (`LoadRates.step_costs`), and m: for
        `adopt_step_costs` once the policy is back to its priors (the warm-up's timed pass)."""
        return {b: r.step_costs() for b, r in self._rates.items() if r.plain_step_s}, self.draft_cost

    def adopt_step_costs(self, costs: dict[int, LoadRates], draft_cost: float) -> None:
        """Start from measured step costs (`step_costs`): each load prices drafting at its own
        measured seconds from its first step (`_costs`, `_prior_pays`), rather than at the cost
        model's until probes have paid to measure them. A burst of 64 nano requests passes each
        load for a few steps only, and probing there on the H100 (2026-12-06) made speculation
        on 0.73x off at c = 64. Acceptance stays the prior's: the timed pass's prompts were random."""
        if not self.is_calibrated:
            return
        for bucket, rates in costs.items():
            self._rates[bucket] = rates.step_costs()
        self.draft_cost = draft_cost

    def may_draft(self, num_seqs: int) -> bool:
        """Whether `num_seqs` decoding sequences (all able to draft) may draft, as far as is known
        before they run: no load measured there (its probe will tell), drafting measured winning,
        or some k beating a plain step at the load's measured step costs and the acceptance the
        policy would price them at (the recent requests' up to `OWN_MAX_SEQS`, with the
        `START_MARGIN` drafting must clear to start there, else the shared estimate). A prompt joining a load where none of that holds is not worth the MTP layer
        over its chunks (decoder.py `fills_draft_kv`): a catch-up pays for it if drafting comes."""
        if self.forced_k is not None or not self.is_adaptive:
            return self.forced_k != 0
        load = StepLoad(num_rows=num_seqs, num_drafting=num_seqs)
        rates = self._rates.get(load_bucket(num_seqs))
        if rates is not None and rates.is_winning:
            return True
        costs = self._costs(load)
        if costs is None:
            return True
        if num_seqs <= OWN_MAX_SEQS:  # priced at their own acceptance, and drafting starts here
            by_k = self.rates(load, self.recent, measured=costs)
            return max(by_k[1:]) > (1 + START_MARGIN) * by_k[0]
        by_k = self.rates(load, self.acceptance, measured=costs)
        return max(by_k[1:]) > by_k[0]

    def max_paying_seqs(self, limit: int) -> int:
        """The most sequences (up to `limit`) at which a decode step could gain from drafting under
        the cost model with every draft accepted and the current m (the decoder asks once, at the
        start: the starting m); past it no k pays. A fixed
        policy (not adaptive) always drafts: `limit`."""
        if not self.is_adaptive:
            return limit
        loads = (StepLoad(num_rows=b, num_drafting=b) for b in range(limit, 0, -1))
        return next((load.num_rows for load in loads if self._would_pay_if_accepted(load)), 0)

    def _would_pay_if_accepted(self, load: StepLoad, m: float | None = None) -> bool:
        """Some k > 0 beats k = 0 with every draft accepted, at m (default: the measured one; per
        load and m: remembered)."""
        m = self.draft_cost if m is None else m
        key = (load, m)
        pays = self._pays_if_accepted.get(key)
        if pays is None:
            if len(self._pays_if_accepted) > 1024:  # loads and measured m vary: keep it bounded
                self._pays_if_accepted.clear()
            rates = self.rates(load, [1.0] * self.max_drafts, m)
            pays = self._pays_if_accepted[key] = max(rates[1:]) > rates[0]
        return pays

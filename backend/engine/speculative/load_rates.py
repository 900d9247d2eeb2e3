"""What the draft policy has measured at each load (backend/engine/speculative/policy.py).

A load is the step's sequences rounded up to a power of two (`load_bucket`). Per load: the output
tokens per second of plain steps and of steps that verified drafts, each kind's step seconds, the
catch-ups' seconds, the overhead of a drafting step beyond the cost model and each draft length's
measured seconds, and the state of its probes (`LoadRates`). `Loads` answers what a load has not
measured yet from the nearest load that has (`NEAR_DOUBLINGS`), else the dearest measured.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

RATE_WEIGHT = 0.2  # per measured step, in a load's tokens-per-second estimates
SPEC_RATE_WEIGHT = 0.05  # per verifying step, in a load's drafting rate: ~20 steps make it
MIN_RATE_SAMPLES = 3  # steps of a kind measured at a load before its rate is trusted
# sequences' verifies a probe measures (at least MIN_RATE_SAMPLES steps): one user's tokens per
# verify vary from 1 to K + 1 (sd ~1.2 at E(3) ~2.8), so 16 of them put its rate within ~11%
PROBE_VERIFIES = 16
CLEAR_LOSS = 1 / 3  # a probe measured at under this share of the plain rate has lost: it ends early
PROBE_SHARE = 0.05  # of a load's plain-step time, the most its later probes may cost
DRAFT_STEP_GUESS = 4.0  # a drafting step's cost in plain steps, before one is measured at a load
# a step this many times its kind's estimate is cold (kernels compiled, the host stalled): not a
# rate the next steps run at, and its seconds enter the estimate at this many times it at most
# (the H100's first drafting steps, 2026-12-05, measured m at 27.8: no draft length paid again)
COLD_RATIO = 4.0
# a load's missing estimates (a drafting step's cost in plain steps, a step's seconds for the cold
# bound) come from the nearest measured load within this many doublings of its sequences (steps of
# 2-4x the sequences cost about the same while weights bound them), else from the dearest measured
NEAR_DOUBLINGS = 2


@dataclass(slots=True)
class LoadRates:
    """One load's measured output tokens per second (plain steps, steps that verified drafts), its
    steps' seconds, and its probes."""

    plain: float = 0.0
    spec: float = 0.0  # spec_tokens / spec_s
    spec_tokens: float = 0.0  # verifying steps' tokens and seconds, decayed by SPEC_RATE_WEIGHT
    spec_s: float = 0.0
    num_plain: int = 0
    num_spec: int = 0  # verifying steps measured since the load's last probe began
    plain_step_s: float = 0.0  # EWMA seconds of a plain step
    draft_step_s: float = 0.0  # EWMA seconds of a drafting step (verifying or only proposing)
    plain_s_since_probe: float = 0.0  # plain steps' seconds since its last probe began
    catch_up_s: float = 0.0  # EWMA seconds of a step that caught up MTP KV (`observe_catch_up`)
    catch_up_row_s: float = 0.0  # EWMA seconds a caught-up position cost beyond a drafting step
    # EWMA of a verifying step's cost beyond the cost model's, in plain steps (`observe_step`): the
    # fixed part of a drafting step the model does not price (module docstring), >= 0
    overhead: float = 0.0
    num_overhead: int = 0
    # by draft length, a verifying step's EWMA seconds and the load's verifying step it was last
    # taken at (`observe_step`): a k's measured cost while fresh (`_costs`)
    step_s_by_k: dict[int, tuple[float, int]] = field(default_factory=dict)
    num_verifying: int = 0  # verifying steps measured at this load
    num_probes: int = 0
    is_probing: bool = False  # a probe began here and has not been judged yet
    is_winning: bool = False  # its last probe measured drafting faster, and nothing since slower
    since_refresh: int = 0  # drafting steps since a plain one refreshed `plain`

    def add_plain(self, rate: float) -> None:
        self.plain = rate if not self.num_plain else self.plain + RATE_WEIGHT * (rate - self.plain)
        self.num_plain += 1

    def add_spec(self, num_tokens: int, seconds: float) -> None:
        """Tokens over seconds of the recent verifying steps (not a mean of each step's rate: the
        tokens vary, the seconds hardly do)."""
        self.spec_tokens += num_tokens - SPEC_RATE_WEIGHT * self.spec_tokens
        self.spec_s += seconds - SPEC_RATE_WEIGHT * self.spec_s
        self.spec = self.spec_tokens / self.spec_s
        self.num_spec += 1

    def step_costs(self) -> LoadRates:
        """A copy with what this load's steps cost and nothing of what they emitted: the plain rate
        and step seconds, the drafting step's seconds by draft length (fresh for the next
        `REPROBE_EVERY` verifying steps) and the overhead; not the catch-ups' seconds (the warm-up
        times its one catch-up before any drafting step there, so the whole step's seconds would
        price each position: 3-5x too dear, and a probe's catch-up would no longer be priced ahead,
        `Loads.catch_up_guess`). The warm-up's
        timed pass (backend/server/warmup.py `calibrate`) keeps these: its prompts are random, so
        its acceptance and drafting rates are not the served requests', but a step's seconds at a
        load hardly depend on what the tokens are."""
        return LoadRates(
            plain=self.plain,
            num_plain=self.num_plain,
            plain_step_s=self.plain_step_s,
            draft_step_s=self.draft_step_s,
            overhead=self.overhead,
            num_overhead=self.num_overhead,
            step_s_by_k={k: (s, 0) for k, (s, _) in self.step_s_by_k.items()},
        )

    def has_clearly_lost(self) -> bool:
        """Drafting measured (`MIN_RATE_SAMPLES` verifies) at under `CLEAR_LOSS` of the plain rate:
        further verifies of its probe would not turn that round (where drafting wins at E(3) ~2.8,
        three verifies average under a third of its rate only if each emits one token: ~0.3%)."""
        return self.num_spec >= MIN_RATE_SAMPLES and self.spec < CLEAR_LOSS * self.plain

    def begin_probe(self) -> None:
        """A fresh measurement of drafting: the last one's (an unlucky run, older conditions) is
        dropped, as is the plain time that paid for it."""
        self.spec = self.spec_tokens = self.spec_s = 0.0
        self.num_spec = 0
        self.num_probes += 1
        self.is_probing = True
        self.plain_s_since_probe = 0.0

    def cold_limit(self, is_drafting: bool) -> float:
        """The seconds past which a step of the kind is cold here: `COLD_RATIO` times its estimate
        (a drafting step's before one is measured: `DRAFT_STEP_GUESS` plain steps); inf before
        any."""
        if is_drafting:
            estimate = self.draft_step_s or DRAFT_STEP_GUESS * self.plain_step_s
        else:
            estimate = self.plain_step_s
        return COLD_RATIO * estimate if estimate else math.inf

    def add_seconds(self, is_drafting: bool, seconds: float) -> None:
        if is_drafting:
            self.draft_step_s = ewma(self.draft_step_s, seconds)
        else:
            self.plain_step_s = ewma(self.plain_step_s, seconds)
            self.plain_s_since_probe += seconds

    def can_afford_probe(self, num_steps: int, draft_over_plain: float, catch_up_s: float = 0.0) -> bool:
        """A probe of `num_steps` drafting steps (and a catch-up of `catch_up_s` where it is not paid
        after the fact) is expected to cost within `PROBE_SHARE` of the plain time since the last
        one (a drafting step here as measured, else `draft_over_plain` plain steps)."""
        step_s = self.draft_step_s or draft_over_plain * self.plain_step_s
        return PROBE_SHARE * self.plain_s_since_probe >= num_steps * step_s + catch_up_s


def ewma(value: float, sample: float) -> float:
    return sample if not value else value + RATE_WEIGHT * (sample - value)


def load_bucket(num_seqs: int) -> int:
    """The power of two at or above `num_seqs`: loads measured together."""
    return 1 << max(num_seqs - 1, 0).bit_length()


def probe_verifies(bucket: int) -> int:
    """Verifying steps a probe at `bucket` sequences measures: `PROBE_VERIFIES` sequences' verifies
    (a step's tokens are a sum over its sequences: the more of them, the less it varies)."""
    return max(MIN_RATE_SAMPLES, -(-PROBE_VERIFIES // bucket))


class Loads(dict[int, LoadRates]):
    """Load bucket -> its `LoadRates`, and the estimates one load borrows from another."""

    def at(self, bucket: int) -> LoadRates:
        """`bucket`'s rates, made empty the first time (not `setdefault`: that builds a LoadRates
        on every call, a few µs of every plain step)."""
        rates = self.get(bucket)
        if rates is None:
            rates = self[bucket] = LoadRates()
        return rates

    def catch_up_guess(self, bucket: int, rates: LoadRates) -> float:
        """The catch-up a probe at `bucket` sequences that never caught up is priced at ahead: the
        dearest per sequence measured at any load (less that load's drafting step), times its sequences (0: none measured; a load
        that has measured its own pays each after the fact, `DraftPolicy.observe_catch_up`). On the H100 a
        probe at 64 Kimi users, priced at four drafting steps, caught 64 sequences up: ~40-80 ms,
        a third of a c=64 bench run (0.61x that round, 2026-12-05)."""
        if rates.catch_up_s:
            return 0.0
        # a catch-up step also proposes: a drafting step's own cost comes off before the division
        per_seq = max(
            (max(0.0, r.catch_up_s - r.draft_step_s) / b for b, r in self.items() if r.catch_up_s),
            default=0.0,
        )
        return per_seq * bucket

    def draft_over_plain(self, bucket: int) -> float:
        """A drafting step's cost in plain steps at `bucket`: as measured nearby, else a guess."""
        return self.measured_draft_over_plain(bucket) or DRAFT_STEP_GUESS

    def measured_draft_over_plain(self, bucket: int) -> float:
        """A drafting step's cost in plain steps at `bucket`: at the nearest load that measured both
        within `NEAR_DOUBLINGS`, else the most measured at any load (0: none yet). Not the most
        everywhere: a dear ratio at 64 sequences (~10 plain steps) must not price a probe for one
        user once a load near it has measured its own (~2.7)."""

        def has_both(r: LoadRates) -> bool:
            return r.draft_step_s > 0 and r.plain_step_s > 0

        near = self.near(bucket, has_both)
        if near is not None:
            return near.draft_step_s / near.plain_step_s
        measured = [r.draft_step_s / r.plain_step_s for r in self.values() if has_both(r)]
        return max(measured, default=0.0)

    def near(self, bucket: int, has: Callable[[LoadRates], bool]) -> LoadRates | None:
        """The measured load (`has`) nearest `bucket` within `NEAR_DOUBLINGS` doublings (itself
        first; ties: the smaller load), or None."""
        found = [
            (abs(b.bit_length() - bucket.bit_length()), b, r)
            for b, r in self.items()
            if has(r) and abs(b.bit_length() - bucket.bit_length()) <= NEAR_DOUBLINGS
        ]
        return min(found, key=lambda f: (f[0], f[1]))[2] if found else None

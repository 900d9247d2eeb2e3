"""Warm before ready (issue 25): before `/v1/health` says ok, a GPU backend runs a step of every shape
it will take, so each Triton kernel specialisation compiles (or loads from the persistent compile
cache in the data dir, `BackendSettings.compile_cache_dir`) here and not inside a user's first
request: on the H200 a cold backend answered the first request of each new shape in 3.3–5.5 s
where a warm one takes ~40 ms (2026-12-04).

Shapes (budget = `max_num_batched_tokens`, buckets = the CUDA-graph batch sizes, the Triton
launchers specialise on powers of two and on divisibility by 16):

    prefill alone   one prompt of T tokens, T in {2^k, 2^k - 1} up to the budget, and one prompt of
                    2 x budget + 1 (later chunks attend to pages an earlier chunk wrote)
    decode          B rows, for each bucket B (the graphs were captured when the engine was built;
                    these replay them, or run eagerly when graphs are off)
    mixed           a prompt chunk of budget - B tokens beside B decode rows, for each bucket B below
                    `max_num_seqs`
    speculative     (an engine with `--speculative mtp:K`) one request at a time, greedy and sampled,
                    prompts of 16 tokens and of every power of two from 256 up to 8,192 (and the
                    window), each decoding through a fixed pattern of draft lengths: every k in
                    1 … K, k growing and shrinking between steps, a plain step and the catch-up after
                    it, and the request's tail at `max_tokens`. The whole-step graphs were captured
                    when the engine was built; the steps that run outside them (a catch-up, drafts
                    fewer than k, a tail) launch attention whose slices, and so its kernels'
                    specialisations, follow the sequence's length (H100, 2026-12-06: a 0.9 s MLA compile
                    inside a GLM nano run after two full passes over the same prompts)
    calibration     (an adaptive, measuring `--speculative` policy) for each load the policy tells
                    apart (1, 2, 4, … sequences up to `max_drafting_seqs`), that many requests decode
                    through plain steps, then each draft length: twice, the first pass compiling
                    (verify and draft shapes of many sequences), the second timed. The policy starts
                    serving with the timed pass's step costs per load (`DraftPolicy.adopt_step_costs`;
                    not its acceptance: the prompts are random), so it prices drafting at a load from
                    its first step there instead of probing it, and a burst that passes each load for
                    a few steps pays no probes (H100, 2026-12-06: speculation on ran 0.73x off at
                    c = 64 on GLM nano, a third of its steps probes and their compiles)
A shape the pool cannot hold is skipped. Every warm-up request ends before `warm_up` returns: the
pool is empty again, and the steps count in the engine's stats like any other.
The CPU runs one step of one two-token prompt: its torch references compile nothing, so start-up
stays fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from backend.engine.engine import Engine
from backend.engine.speculative.decoder import SpecDecoder
from backend.engine.speculative.load_rates import LoadRates
from schemas.backend import EngineRequest, SamplingParams

SALT = "f" * 32  # no tenant's: the gateway derives tenant salts, this one is fixed and never sent


# the speculative sweep's draft length a step (0: a plain step, whose positions the next catches up)
SPEC_PATTERN = ("K", 1, "K", 0, "K", 2, 1, 0, 1, "K")
SPEC_SHORT, SPEC_LONG = 16, (256, 8192)  # prompt lengths: one short, powers of two between these
# the calibration's steps of each kind at a load (the first drafting step after plain ones only
# proposes and catches up, and the first of a new draft length is priced at neither): its prompts
CALIBRATION_STEPS, CALIBRATION_PROMPT = 4, 16


@dataclass(frozen=True, slots=True)
class WarmUp:
    seconds: float
    num_steps: int
    num_requests: int
    # the speculative sweep's steps by draft length (-1: a drafting step that caught MTP KV up)
    spec_steps: dict[int, int] = field(default_factory=dict)


def warm_up(engine: Engine, *, is_full: bool, calibrate: bool = True) -> WarmUp:
    """Run the shapes above (`is_full`, a GPU) or one tiny step (the CPU); every request finishes.
    `calibrate` False: no calibration passes (the draft policy starts from its priors alone, as
    before 2026-12-06: for benchmarks that compare the two)."""
    start, steps0 = time.perf_counter(), engine.stats.steps
    plan = _Plan(engine)
    learned = engine.spec.policy_state() if engine.spec is not None else None
    costs = None
    try:
        if is_full:
            plan.prefills()
            plan.decodes_and_mixed()
            plan.speculative()
            costs = plan.calibrate(learned) if calibrate else None
        else:
            plan.run([(2, 1)])
    finally:  # the draft policy starts serving from its priors, not from the warm-up's random prompts
        if engine.spec is not None and learned is not None:
            engine.spec.restore_policy(learned)
    if engine.spec is not None and costs is not None:  # ... and from the step costs it timed
        engine.spec.policy.adopt_step_costs(*costs)
    return WarmUp(
        time.perf_counter() - start, engine.stats.steps - steps0, plan.num_requests, plan.spec_steps
    )


class _Plan:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        config = engine.config
        self.budget, self.page_size = config.max_num_batched_tokens, config.page_size
        self.num_pages = config.num_pages
        self.buckets = config.graph_batch_sizes()
        self.window, self.vocab_size = engine.scheduler.context_window, engine.scheduler.vocab_size
        self.num_requests = 0
        self.spec_steps: dict[int, int] = {}

    def pages(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def prefills(self) -> None:
        lengths = {2**k for k in range(1, self.budget.bit_length())} | {self.budget, 2 * self.budget + 1}
        lengths |= {t - 1 for t in lengths if t > 2}
        for length in sorted(lengths):
            if self.pages(length + 1) <= self.num_pages and length + 1 <= self.window:
                self.run([(length, 1)])

    def decodes_and_mixed(self) -> None:
        """Per bucket B: B short requests decode alone, then a prompt of the budget arrives beside them."""
        for rows in self.buckets:
            decoding = [(2, 6)] * rows
            # (no prompt longer than the window: one request cannot fill a budget past it)
            prompt = (
                [(min(self.budget, self.window - 1), 1)] if rows < self.engine.config.max_num_seqs else []
            )
            if rows * self.pages(8) + sum(self.pages(t + 1) for t, _ in prompt) > self.num_pages:
                continue
            self.add(decoding)
            for _ in range(2):  # the prompts' step, then one step of B decode rows alone
                self.step()
            self.run(prompt)  # decode first, then the chunk fills the rest of the budget

    def speculative(self) -> None:
        """The speculative sweep (module docstring): the policy forced through `SPEC_PATTERN`, then
        left to itself again."""
        spec = self.engine.spec
        if spec is None or spec.max_drafting_seqs < 1:
            return
        K, policy = spec.K, spec.policy
        pattern = [K if k == "K" else min(int(k), K) for k in SPEC_PATTERN]
        lengths = [SPEC_SHORT] + [
            2**e for e in range(SPEC_LONG[0].bit_length() - 1, SPEC_LONG[1].bit_length())
        ]
        lengths.append(self.window - 4 * len(pattern) * (K + 1))  # the window's longest prompt that fits
        max_tokens = 2 * len(pattern) * (K + 1)  # outlasts the pattern; its tail runs past it
        try:
            for length in sorted({t for t in lengths if t > 0}):
                if self.pages(length + max_tokens) > self.num_pages or length + max_tokens > self.window:
                    continue
                for temperature in (0.0, 1.0):
                    self.add([(length, max_tokens)], temperature=temperature)
                    at = 0  # the pattern's step: decode steps only (a long prompt's chunks first)
                    while self.engine.has_unfinished:
                        running = self.engine.scheduler.running
                        is_decoding = bool(running) and running[0].num_output_tokens > 0
                        policy.forced_k = (pattern[at] if at < len(pattern) else None) if is_decoding else K
                        self.step()
                        k = spec.k
                        self.spec_steps[k] = self.spec_steps.get(k, 0) + 1
                        if k and spec.did_catch_up:
                            self.spec_steps[-1] = self.spec_steps.get(-1, 0) + 1
                        at += is_decoding
        finally:
            policy.forced_k = None

    def calibrate(self, learned: dict[str, Any] | None) -> tuple[dict[int, LoadRates], float] | None:
        """The calibration passes (module docstring): the timed pass's step costs per load and m,
        measured from the policy's priors (`learned`); None without an adaptive, measuring policy."""
        spec = self.engine.spec
        if spec is None or learned is None or spec.max_drafting_seqs < 1:
            return None
        policy = spec.policy
        if not (policy.is_adaptive and policy.is_calibrated):
            return None
        K = spec.K
        pattern = [0] * CALIBRATION_STEPS
        for k in (K, *range(1, K)):  # K first: the step after plain ones proposes K for the next
            pattern += [k] * CALIBRATION_STEPS
        max_tokens = (len(pattern) + 2) * (K + 1)  # outlasts the pattern (ended by aborts)
        limit = min(spec.max_drafting_seqs, self.engine.config.max_num_seqs)
        loads, bucket = [], 1
        while True:  # each load bucket (a power of two) the policy measures apart, at most `limit`
            loads.append(min(bucket, limit))
            if bucket >= limit:
                break
            bucket *= 2
        length = CALIBRATION_PROMPT
        fits = [  # the pool holds them; their prompts are one step, and so are their verify rows
            n
            for n in loads
            if n * self.pages(length + max_tokens) <= self.num_pages
            and length + max_tokens <= self.window
            and n * max(length, K + 1) <= self.budget
        ]
        try:
            for is_timed in (False, True):
                if is_timed:  # measured from the priors: nothing of the compiling pass
                    spec.restore_policy(learned)
                for n in fits:
                    self._calibrate_load(spec, n, length, max_tokens, pattern)
        finally:
            policy.forced_k = None
        spec.settle()  # the last steps' measurements, not yet told
        return policy.step_costs()

    def _calibrate_load(
        self, spec: SpecDecoder, n: int, length: int, max_tokens: int, pattern: list[int]
    ) -> None:
        """`n` requests of `length` tokens: their prompts (the MTP KV written beside them, as
        `speculative` forces), then `pattern`'s draft lengths a step, then aborted."""
        engine, policy = self.engine, spec.policy
        first = self.num_requests
        self.add([(length, max_tokens)] * n)
        ids = [f"warm-up-{i}" for i in range(first, self.num_requests)]
        at = 0
        while engine.has_unfinished and at < len(pattern):
            running = engine.scheduler.running
            is_decoding = len(running) == n and all(s.num_output_tokens > 0 for s in running)
            policy.forced_k = pattern[at] if is_decoding else spec.K
            self.step()
            at += is_decoding
        for request_id in ids:
            engine.abort(request_id)
        while engine.has_unfinished:
            for out in engine.step():  # each ends "aborted", as asked
                if out.error is not None and out.finish_reason != "abort":
                    raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error.message}")

    def run(self, requests: list[tuple[int, int]]) -> None:
        """Add (prompt tokens, output tokens) requests, then step until every request has finished."""
        self.add(requests)
        while self.engine.has_unfinished:
            self.step()

    def add(self, requests: list[tuple[int, int]], *, temperature: float = 0.0) -> None:
        for length, max_tokens in requests:
            request_id = f"warm-up-{self.num_requests}"
            self.num_requests += 1
            prompt = [(self.num_requests * 7919 + i) % (self.vocab_size - 1) + 1 for i in range(length)]
            sampling = SamplingParams(
                max_tokens=max_tokens, temperature=temperature, ignore_eos=True, seed=self.num_requests
            )
            request = EngineRequest(
                request_id=request_id, prompt_token_ids=prompt, tenant_salt=SALT, sampling=sampling
            )
            self.engine.add_request(request)

    def step(self) -> None:
        for out in self.engine.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error.message}")

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
A shape the pool cannot hold is skipped. Every warm-up request ends before `warm_up` returns: the
pool is empty again, and the steps count in the engine's stats like any other.
The CPU runs one step of one two-token prompt: its torch references compile nothing, so start-up
stays fast.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from backend.engine.engine import Engine
from schemas.backend import EngineRequest, SamplingParams

SALT = "f" * 32  # no tenant's: the gateway derives tenant salts, this one is fixed and never sent


@dataclass(frozen=True, slots=True)
class WarmUp:
    seconds: float
    num_steps: int
    num_requests: int


def warm_up(engine: Engine, *, is_full: bool) -> WarmUp:
    """Run the shapes above (`is_full`, a GPU) or one tiny step (the CPU); every request finishes."""
    start, steps0 = time.perf_counter(), engine.stats.steps
    plan = _Plan(engine)
    if is_full:
        plan.prefills()
        plan.decodes_and_mixed()
    else:
        plan.run([(2, 1)])
    return WarmUp(time.perf_counter() - start, engine.stats.steps - steps0, plan.num_requests)


class _Plan:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        config = engine.config
        self.budget, self.page_size = config.max_num_batched_tokens, config.page_size
        self.num_pages = config.num_pages
        self.buckets = config.graph_batch_sizes()
        self.window, self.vocab_size = engine.scheduler.context_window, engine.scheduler.vocab_size
        self.num_requests = 0

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
            prompt = [(self.budget, 1)] if rows < self.engine.config.max_num_seqs else []
            if rows * self.pages(8) + sum(self.pages(t + 1) for t, _ in prompt) > self.num_pages:
                continue
            self.add(decoding)
            for _ in range(2):  # the prompts' step, then one step of B decode rows alone
                self.step()
            self.run(prompt)  # decode first, then the chunk fills the rest of the budget

    def run(self, requests: list[tuple[int, int]]) -> None:
        """Add (prompt tokens, output tokens) requests, then step until every request has finished."""
        self.add(requests)
        while self.engine.has_unfinished:
            self.step()

    def add(self, requests: list[tuple[int, int]]) -> None:
        for length, max_tokens in requests:
            request_id = f"warm-up-{self.num_requests}"
            self.num_requests += 1
            prompt = [(self.num_requests * 7919 + i) % (self.vocab_size - 1) + 1 for i in range(length)]
            sampling = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            request = EngineRequest(
                request_id=request_id, prompt_token_ids=prompt, tenant_salt=SALT, sampling=sampling
            )
            self.engine.add_request(request)

    def step(self) -> None:
        for out in self.engine.step():
            if out.error is not None:
                raise RuntimeError(f"warm-up request {out.request_id} failed: {out.error.message}")

"""Drafting that resumes after idle steps reads the MTP KV an always-on run would have written
(issue 28, "no loss at c=64": the policy turns drafting off, then back on).

A step that drafts nothing is a plain step: no MTP layer runs, so the positions it computes get no
MTP KV. A sequence that drafts again catches up first: its verify chunk starts at the gap, and depth 0
runs the MTP layer over the gap with the accepted positions (backend/engine/speculative/book.py).
Before the catch-up the draft read zeros there (fewer drafts accepted; the outputs stayed exact)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from backend.engine.engine import Engine
from tests.backend.engine.test_speculative import ARCHS, engine_for, loaded, prompts
from tests.backend.engine_helpers import Result, collect, request, run_all

__all__ = ["loaded"]  # the fixture

NUM_IDLE = 6  # plain steps before drafting turns on: the prompts' chunks and a few decodes


class IdleFirst:
    """The first `num_idle` steps are plain (the draft length forced to 0: not even the MTP layer over
    prompt chunks), then the policy's; counts the MTP forwards."""

    def __init__(self, engine: Engine, num_idle: int) -> None:
        spec = engine.spec
        assert spec is not None
        self.num_steps = 0
        self.num_mtp_forwards = 0
        drafting, forward_mtp = spec.drafting, engine.runner.model.forward_mtp

        def idle_first(out: Any, num_requests: int) -> list[bool]:
            self.num_steps += 1
            spec.policy.forced_k = 0 if self.num_steps <= num_idle else None
            return drafting(out, num_requests)

        def counted(*args: Any, **kw: Any) -> Any:
            self.num_mtp_forwards += 1
            return forward_mtp(*args, **kw)

        spec.drafting = idle_first  # type: ignore[method-assign]
        engine.runner.model.forward_mtp = counted


def draft_kv(engine: Engine, request_id: str, num_positions: int) -> list[torch.Tensor]:
    """The MTP layer's cache entries of `request_id`'s first `num_positions` positions, per tensor
    `[num_positions, ...]`, read through its page table."""
    seq = engine._seqs[request_id]
    S = engine.block_manager.page_size
    positions = torch.arange(num_positions)
    pages = torch.tensor([ref.page_id for ref in seq.page_table])[positions // S]
    return [cache[pages, positions % S].clone() for cache in engine.runner.kv_cache.layers[-1].values()]


@pytest.mark.parametrize("arch", ARCHS)
def test_drafting_resumes_with_the_mtp_kv_of_an_always_on_run(loaded: dict[str, Any], arch: str) -> None:
    """`NUM_IDLE` plain steps (prompts in chunks, then decodes) run no MTP layer; the first drafting
    step after them leaves every sequence's MTP KV whole, equal (fp32) to what a run drafting from
    its first step wrote at the same positions; greedy outputs equal speculation off's."""
    model = loaded[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=40, ignore_eos=True)
        for i, p in enumerate(prompts(6, model.config.vocab_size, seed=3))
    ]
    config = dict(speculative_adaptive=False, max_num_batched_tokens=96)  # 6 prompts of 1-40: chunked
    plain = run_all(engine_for(model, 0, **config), reqs)
    resumed, always = engine_for(model, 3, **config), engine_for(model, 3, **config)
    idle = IdleFirst(resumed, NUM_IDLE)
    results: dict[str, dict[str, Result]] = {"resumed": {}, "always": {}}
    for engine in (resumed, always):
        for r in reqs:
            engine.add_request(r)
    for _ in range(NUM_IDLE):
        collect(results["resumed"], resumed.step())
    assert idle.num_mtp_forwards == 0 and resumed.stats.spec_drafted_tokens == 0
    seqs = list(resumed.scheduler.running)
    assert len(seqs) == len(reqs) and all(s.num_draft_kv_tokens < s.num_computed_tokens for s in seqs)
    while not all(s.num_draft_kv_tokens == s.num_computed_tokens > 0 for s in seqs):
        collect(results["resumed"], resumed.step())  # caught up within the token budget: a few steps
    assert idle.num_steps <= NUM_IDLE + 4
    caught_up = {s.request_id: s.num_computed_tokens for s in seqs}
    while not all(always._seqs[rid].num_draft_kv_tokens >= n for rid, n in caught_up.items()):
        collect(results["always"], always.step())
    for rid, n in caught_up.items():
        for got, want in zip(draft_kv(resumed, rid, n), draft_kv(always, rid, n), strict=True):
            assert got.abs().sum() > 0
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=rid)
    for name, engine in (("resumed", resumed), ("always", always)):
        while engine.has_unfinished:
            collect(results[name], engine.step())
        assert engine.stats.spec_accepted_tokens >= 0 and engine.stats.tag_check_aborts == 0
        assert engine.block_manager.num_available_pages == engine.block_manager.num_pages
        for r in reqs:
            assert results[name][r.request_id].token_ids == plain[r.request_id].token_ids, (
                name,
                r.request_id,
            )


@pytest.mark.parametrize("arch", ARCHS)
def test_a_gap_too_long_for_any_step_is_left_as_zeros(loaded: dict[str, Any], arch: str) -> None:
    """A sequence whose gap could never fit a step's token budget drafts without catching up (its
    gap's MTP KV stays zero); its verifies stay out of the acceptance every sequence's draft length
    is chosen by (drafts read over zeros are accepted less); outputs stay exact and the pool whole."""
    model = loaded[arch]
    reqs = [request("r", prompts(1, model.config.vocab_size, seed=4)[0] * 4, max_tokens=24, ignore_eos=True)]
    config = dict(speculative_adaptive=False, max_num_batched_tokens=16)  # MAX_GAP_SHARE: a gap over 8
    plain = run_all(engine_for(model, 0, **config), reqs)
    engine = engine_for(model, 3, **config)
    IdleFirst(engine, 12)
    assert engine.spec is not None
    acceptance = list(engine.spec.policy.acceptance)
    got: dict[str, Result] = {}
    engine.add_request(reqs[0])
    while engine.stats.spec_drafted_tokens == 0:  # 12 plain steps, then the first drafting steps
        collect(got, engine.step())
    (seq,) = engine.scheduler.running
    assert seq.num_draft_kv_tokens == seq.num_computed_tokens > 8 and engine.spec.book.has_hole(seq)
    assert all(bool((kv == 0).all()) for kv in draft_kv(engine, "r", 8))  # the gap given up
    while engine.has_unfinished:
        collect(got, engine.step())
    assert got["r"].token_ids == plain["r"].token_ids
    assert engine.stats.spec_verifies > 0 and engine.spec.policy.acceptance == acceptance
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages


@pytest.mark.parametrize("arch", ARCHS)
def test_a_prompt_chunk_that_catches_up_keeps_its_prompt_logprobs(loaded: dict[str, Any], arch: str) -> None:
    """A prompt whose first chunk ran in a plain step ends in a drafting step: its verify chunk
    starts at the gap, yet its prompt log-probs are the last chunk's rows (and the tokens and their
    log-probs those of speculation off)."""
    model = loaded[arch]
    p = prompts(2, model.config.vocab_size, seed=8)
    long = [(x * 60)[:60] for x in p]
    reqs = [
        request(
            f"r{i}", x, max_tokens=12, ignore_eos=True, logprobs=True, top_logprobs=2, prompt_logprobs=True
        )
        for i, x in enumerate(long)
    ]
    config = dict(speculative_adaptive=False, max_num_batched_tokens=96)  # one prompt in 36 tokens, then 24
    plain = run_all(engine_for(model, 0, **config), reqs)
    engine = engine_for(model, 3, **config)
    idle = IdleFirst(engine, 1)
    got: dict[str, Result] = {}
    for r in reqs:
        engine.add_request(r)
    collect(got, engine.step())
    (chunked,) = [s for s in engine.scheduler.running if s.num_computed_tokens < 60]
    assert idle.num_mtp_forwards == 0 and chunked.num_computed_tokens == 36
    assert chunked.num_draft_kv_tokens == 0
    collect(got, engine.step())  # its last chunk, the gap caught up in the same verify
    assert chunked.num_draft_kv_tokens == chunked.num_computed_tokens == 60 and idle.num_mtp_forwards > 0
    while engine.has_unfinished:
        collect(got, engine.step())
    for r in reqs:
        rid = r.request_id
        want, have = plain[rid], got[rid]
        assert have.token_ids == want.token_ids, rid
        assert have.prompt_logprobs is not None and want.prompt_logprobs is not None
        assert len(have.prompt_logprobs) == len(want.prompt_logprobs) == 60
        for a, b in zip(have.prompt_logprobs[1:], want.prompt_logprobs[1:], strict=True):
            assert a is not None and b is not None and a.token_id == b.token_id
            assert abs(a.logprob - b.logprob) < 1e-4, rid
        for a, b in zip(have.logprobs, want.logprobs, strict=True):
            assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4, rid


def target_kv(engine: Engine, request_id: str, num_positions: int) -> list[torch.Tensor]:
    """The target layers' cache entries of `request_id`'s first `num_positions` positions."""
    seq = engine._seqs[request_id]
    S = engine.block_manager.page_size
    positions = torch.arange(num_positions)
    pages = torch.tensor([ref.page_id for ref in seq.page_table])[positions // S]
    num_target = len(engine.runner.kv_cache.layers) - engine.runner.model.num_mtp_layers
    return [
        cache[pages, positions % S].clone()
        for layer in engine.runner.kv_cache.layers[:num_target]
        for cache in layer.values()
    ]


@pytest.mark.parametrize("arch", ARCHS)
def test_a_catch_up_leaves_the_target_kv_of_its_gap_as_it_was(loaded: dict[str, Any], arch: str) -> None:
    """The verify recomputes a gap's hidden states, but its target KV stays the bytes the plain
    steps wrote: those pages may be published and read by other sequences (prefix-cache hits),
    and a recompute in another batch shape differs in the last bits (fp32 on this CPU: ~8% of the
    entries), so rewriting them would change other requests' context under them."""
    model = loaded[arch]
    reqs = [
        request(f"r{i}", p, max_tokens=40, ignore_eos=True)
        for i, p in enumerate(prompts(6, model.config.vocab_size, seed=3))
    ]
    engine = engine_for(model, 3, speculative_adaptive=False, max_num_batched_tokens=96)
    IdleFirst(engine, NUM_IDLE)
    got: dict[str, Result] = {}
    for r in reqs:
        engine.add_request(r)
    for _ in range(NUM_IDLE):
        collect(got, engine.step())
    seqs = list(engine.scheduler.running)
    before = {s.request_id: target_kv(engine, s.request_id, s.num_computed_tokens) for s in seqs}
    while not all(s.num_draft_kv_tokens == s.num_computed_tokens > 0 for s in seqs):
        collect(got, engine.step())
    assert engine.stats.tag_check_aborts == 0
    for rid, kv in before.items():
        n = kv[0].shape[0]
        for was, now in zip(kv, target_kv(engine, rid, n), strict=True):
            assert torch.equal(was, now), rid


@pytest.mark.parametrize("arch", ARCHS)
def test_a_hit_on_pages_of_plain_steps_catches_up_their_mtp_kv(loaded: dict[str, Any], arch: str) -> None:
    """A writer that ran plain steps only publishes pages without MTP KV; a drafting request that
    hits them catches up over them (it does not count zeros as its MTP KV): after its first step its
    MTP KV there equals (fp32) what a run drafting from the start wrote, the pages are then whole
    for a later hit, which catches up nothing; greedy outputs equal speculation off's."""
    model = loaded[arch]
    system = (prompts(1, model.config.vocab_size, seed=5)[0] * 24)[:24]  # 3 pages of 8
    tails = prompts(3, model.config.vocab_size, seed=6)
    reqs = [request(f"r{i}", system + t[:5], max_tokens=8, ignore_eos=True) for i, t in enumerate(tails)]
    config = dict(speculative_adaptive=False, max_num_batched_tokens=96)
    plain = run_all(engine_for(model, 0, **config), reqs)
    engine, always = engine_for(model, 3, **config), engine_for(model, 3, **config)
    spec = engine.spec
    assert spec is not None
    spec.policy.forced_k = 0  # the writer: plain steps (not even the MTP layer over its prompt)
    got: dict[str, Result] = {}
    engine.add_request(reqs[0])
    while engine.has_unfinished:
        collect(got, engine.step())
    assert engine.stats.spec_drafted_tokens == 0
    spec.policy.forced_k = None
    engine.add_request(reqs[1])
    collect(got, engine.step())  # its prompt: 24 tokens hit, 5 computed, the 24 caught up
    hitter = engine._seqs["r1"]
    assert hitter.num_cached_tokens == 24 and spec.did_catch_up
    assert hitter.num_draft_kv_tokens == hitter.num_whole_draft_kv_tokens == hitter.num_computed_tokens
    always.add_request(reqs[1])
    collect({}, always.step())
    for have, want in zip(draft_kv(engine, "r1", 29), draft_kv(always, "r1", 29), strict=True):
        assert have.abs().sum() > 0
        torch.testing.assert_close(have, want, rtol=1e-4, atol=1e-5)
    engine.add_request(reqs[2])
    collect(got, engine.step())  # a later hit: the 24 tokens' MTP KV is whole now
    assert engine._seqs["r2"].num_cached_tokens == 24 and not spec.did_catch_up
    while engine.has_unfinished:
        collect(got, engine.step())
    assert engine.stats.spec_drafted_tokens > 0 and engine.stats.tag_check_aborts == 0
    assert engine.block_manager.num_available_pages == engine.block_manager.num_pages
    for r in reqs:
        assert got[r.request_id].token_ids == plain[r.request_id].token_ids, r.request_id

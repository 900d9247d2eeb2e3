"""Whole sampled speculative steps on the device (backend/engine/speculative/sampled.py), on the CPU:
which steps take them, what the host does in one (one copy in, one read back), and that the
tokens they emit are distributed as the target's."""

from __future__ import annotations

import itertools
from typing import Any, cast

import msgspec
import torch

from backend.engine.forward_batch import ForwardBatch, KVCache
from backend.engine.sampler import SampleRow
from backend.engine.speculative.greedy import guard_rows
from backend.engine.speculative.sampled import draw_rows, draw_width, sampled_step
from schemas.backend import ReasoningMarkers, SamplingParams
from tests.backend.engine.test_speculative import (
    chi2_p_value,
    engine_for,
    loaded,
    prompts,
    toy_engine,
    trigram_counts,
)
from tests.backend.engine.test_speculative_greedy import graphed
from tests.backend.engine_helpers import request, run_all
from tests.backend.speculative_toy import MarkovModel

__all__ = ["loaded"]  # the fixture


def count_reads(engine: Any) -> tuple[list[int], Any]:
    """Per step of `engine`, its host reads of tensors (`.tolist()`, `.item()`, `.cpu()`), counted
    on whole steps; returns the list (appended to) and the undo."""
    reads = [0]
    originals = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "cpu")}

    def counting(name: str) -> Any:
        def read(self: torch.Tensor, *args: Any) -> Any:
            reads[0] += 1
            return originals[name](self, *args)

        return read

    for name in originals:
        setattr(torch.Tensor, name, counting(name))

    def undo() -> None:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)

    return reads, undo


def test_a_sampled_c1_generation_with_a_guard_takes_one_read_per_speculative_step(
    loaded: dict[str, Any],
) -> None:
    """One sampled request with a reasoning guard, always 3 drafts, through the graphs' buffers:
    every speculative step after its prompt's (and before its window's end) is one replay of the
    sampled whole-step graph, with one host read."""
    model = loaded["deepseek_v3"]
    engine = graphed(model, 3, speculative_adaptive=False)
    spec, forwards = engine.spec, engine.runner.spec_forwards
    assert spec is not None and forwards is not None and forwards.graphs is not None
    assert forwards.graphs.has_sampled and spec.is_sampled_enabled
    V = model.config.vocab_size
    markers = ReasoningMarkers(start_id=V - 3, end_id=V - 2, is_open=True)
    req = request("r", prompts(1, V, seed=5)[0], max_tokens=40, temperature=0.9, top_p=0.95, top_k=50, seed=3)
    req = msgspec.structs.replace(req, reasoning_markers=markers, eos_token_ids=[V - 1])
    engine.add_request(req)
    per_step: list[tuple[int, int]] = []  # (whole steps replayed, reads) per step
    reads, undo = count_reads(engine)
    try:
        while engine.has_unfinished:
            replays0, reads[0] = forwards.graphs.num_greedy_replays, 0
            engine.step()
            per_step.append((forwards.graphs.num_greedy_replays - replays0, reads[0]))
    finally:
        undo()
    whole = [r for n, r in per_step if n]
    assert spec.num_sampled_steps == spec.num_greedy_steps == len(whole) > 0
    assert all(r == 1 for r in whole)  # the step's one copy back
    # the others: the prompt's step (it proposes the first drafts) and, within 2k − 1 tokens of
    # max_tokens, those with no pages for a whole step's chained drafts (host path)
    assert per_step[0][0] == 0 and len(per_step) - len(whole) <= 1 + (2 * 3 - 1)


def test_logprobs_keep_the_host_path_and_sampling_takes_the_device(loaded: dict[str, Any]) -> None:
    """Drafting rows wanting logprobs, or penalties, take the host path; sampled rows without
    them run whole steps on the device, as greedy rows do."""
    model = loaded["deepseek_v3"]
    ps = prompts(4, model.config.vocab_size, seed=2)
    engine = engine_for(model, 3, speculative_adaptive=False)  # K drafts whatever the acceptance
    assert engine.spec is not None
    run_all(engine, [request(f"r{i}", p, max_tokens=10, logprobs=True) for i, p in enumerate(ps)])
    run_all(engine, [request(f"p{i}", p, max_tokens=10, temperature=0.8, seed=i, presence_penalty=0.5)
                     for i, p in enumerate(ps)])  # fmt: skip
    assert engine.stats.spec_verifies > 0 and engine.spec.num_greedy_steps == 0
    run_all(engine, [request(f"s{i}", p, max_tokens=10, temperature=0.8, seed=i) for i, p in enumerate(ps)])
    assert engine.spec.num_sampled_steps == engine.spec.num_greedy_steps > 0
    run_all(engine, [request(f"g{i}", p, max_tokens=30) for i, p in enumerate(ps)])
    assert engine.spec.num_greedy_steps > engine.spec.num_sampled_steps


def test_seeded_sampled_requests_repeat_on_the_device_path(loaded: dict[str, Any]) -> None:
    """The uniforms come from each request's seeded generator: the same seeds, the same tokens,
    whatever shares the batch."""
    model = loaded["deepseek_v3"]
    ps = prompts(3, model.config.vocab_size, seed=4)

    def run(ids: list[int]) -> dict[str, list[int]]:
        engine = graphed(model, 2, speculative_adaptive=False)
        reqs = [request(f"s{i}", ps[i], max_tokens=16, temperature=1.0, seed=10 + i) for i in ids]
        out = run_all(engine, reqs)
        assert engine.spec is not None and engine.spec.num_sampled_steps > 0
        return {rid: r.token_ids for rid, r in out.items()}

    together = run([0, 1, 2])
    assert run([1]) == {"s1": together["s1"]}


def test_draw_rows_hold_parameters_and_fresh_uniforms() -> None:
    g = torch.Generator().manual_seed(0)
    sampled = SampleRow(SamplingParams(temperature=0.5, top_k=7, top_p=0.9), g, [1], 1)
    greedy = SampleRow(SamplingParams(temperature=0.0), g, [1], 1)
    first = draw_rows([sampled, greedy], [g, g], 3)
    again = draw_rows([sampled, greedy], [g, g], 3)
    assert first.shape == (2, draw_width(3)) and first.dtype.name == "float64"
    assert first[0, :3].tolist() == [0.5, 7.0, torch.tensor(0.9).item()]
    assert (first[0, 3:] >= 0).all() and (first[0, 3:] < 1).all()
    assert (first[0, 3:] != again[0, 3:]).all()  # each step draws anew
    assert (first[1, 3:] == 0).all()  # a greedy row draws nothing


def top_p_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The sampler's distribution written out: temperature, top-k, top-p (the smallest most likely
    set reaching `top_p`), softmax."""
    x = logits.double() / temperature
    if top_k:
        x[x < x.topk(top_k).values[-1]] = float("-inf")
    p = torch.softmax(x, dim=-1)
    order = p.argsort(descending=True)
    before = p[order].cumsum(0) - p[order]
    x[order[before >= top_p]] = float("-inf")
    return torch.softmax(x, dim=-1)


def test_sampled_device_steps_follow_the_target() -> None:
    """χ² on the (2nd, 3rd, 4th) tokens of one device verify of two drafts with temperature, top-k
    and top-p: accepted drafts, residual draws after a rejection and bonus tokens, as the target."""
    V, x0, N = 6, 0, 4000
    g = torch.Generator().manual_seed(1)
    target = torch.randn(V, V, generator=g) * 1.5
    draft = target + torch.randn(V, V, generator=g)
    engine = toy_engine(MarkovModel(target, draft), 2)
    params = dict(temperature=0.8, top_k=5, top_p=0.9, max_tokens=4)
    counts = trigram_counts(engine, x0, N, V, params)
    probs = [top_p_probs(target[t], 0.8, 5, 0.9) for t in range(V)]
    expected = torch.zeros(V, V, V, dtype=torch.float64)
    for t1, t2, t3, t4 in itertools.product(range(V), repeat=4):
        expected[t2, t3, t4] += probs[x0][t1] * probs[t1][t2] * probs[t2][t3] * probs[t3][t4]
    assert engine.spec is not None and engine.spec.num_sampled_steps >= N // 64  # the verifies: device
    s = engine.stats
    assert 0.2 < s.spec_accepted_tokens / s.spec_drafted_tokens < 0.9  # accepts and rejects both ran
    assert chi2_p_value(counts.flatten(), expected.flatten()) > 1e-3


class OneRowModel(torch.nn.Module):
    """Every verify row's next-token logits are `logits [V]`; the MTP head proposes token 0."""

    def __init__(self, logits: torch.Tensor) -> None:
        super().__init__()
        self.logits = logits

    def forward_spec(self, batch: ForwardBatch, step: object = None) -> tuple[torch.Tensor, torch.Tensor]:
        T = batch.input_ids.shape[0]
        return self.logits.expand(T, -1).clone(), torch.zeros(T, 1)

    def forward_mtp(
        self, batch: ForwardBatch, hidden: torch.Tensor, depth: int, step: object = None, **_: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.zeros(batch.logits_indices.shape[0], 2), hidden

    def build_step(self, batch: ForwardBatch) -> None:
        return None


def test_a_residual_or_bonus_draw_resolves_a_long_tail() -> None:
    """The inverse-CDF draw of a whole sampled step keeps tokens far below 2^-24 apart: a uniform
    inside one tail token's interval of the target's CDF (behind a head of 0.9) draws that token,
    after a rejection (the residual) and after an acceptance (the bonus). A float32 uniform or CDF
    rounds such a point by dozens of tokens (its spacing near 0.9: 6e-8, the tokens' 1e-9), and
    drops mass beyond what the host sampler's Gumbel draw would."""
    V, tail = 8192, 1e-9
    p = torch.full((V,), tail, dtype=torch.float64)
    p[0], p[-1] = 0.9, 0.1 - tail * (V - 2)  # the head first, the tail behind it, then the rest
    logits = p.log().float()
    model = OneRowModel(logits)
    probs = torch.softmax(logits.expand(2, -1), dim=-1)[0].double()  # [V] the step's own
    cdf = probs.cumsum(0)
    draft, want = 5000, 3000  # a tail draft: p(draft) = 1e-9, and the token each uniform aims at
    residual = cdf - probs[draft] * (torch.arange(V) >= draft)  # without the rejected draft
    gen = torch.Generator().manual_seed(0)
    row = SampleRow(SamplingParams(temperature=1.0), gen, [0], 1)
    for u, cdf_at in ((0.999, residual), (0.0, cdf)):  # rejected: the residual; accepted: the bonus
        draws = draw_rows([row], [gen], 1)
        draws[0, 3] = u
        draws[0, 4:] = (cdf_at[want - 1] + cdf_at[want]) / 2 / cdf_at[-1]  # the v's, mid-interval
        batch = ForwardBatch(
            input_ids=torch.tensor([7, draft]),
            positions=torch.tensor([4, 5]),
            query_start=torch.tensor([0, 2], dtype=torch.int32),
            seq_lens=torch.tensor([6], dtype=torch.int32),
            page_table=torch.zeros((1, 1), dtype=torch.int32),
            expected_tags=torch.zeros((1, 1), dtype=torch.int64),
            slot_mapping=torch.tensor([4, 5]),
            logits_indices=torch.arange(2),
            kv_cache=cast(KVCache, None),
            tag_mismatch=torch.zeros(1, dtype=torch.bool),
        )
        guards = torch.from_numpy(guard_rows([None], [[draft]], V))
        out = sampled_step(model, batch, guards, torch.from_numpy(draws), 1, 8)
        a = int(u == 0.0)
        assert out[0, 0].item() == a and out[0, 1 : 2 + a].tolist() == [draft] * a + [want]


def test_a_seeded_request_draws_alike_on_the_host_path(loaded: dict[str, Any]) -> None:
    """A step takes the host path when any of its rows needs it (here another request's logprobs):
    a seeded request's tokens do not depend on which path its steps took, so on what shares them."""
    model = loaded["deepseek_v3"]
    ps = prompts(2, model.config.vocab_size, seed=4)
    seeded = request("s", ps[0], max_tokens=24, temperature=1.0, top_p=0.9, seed=11)

    def run(*others: Any) -> tuple[list[int], int]:
        engine = graphed(model, 2, speculative_adaptive=False)
        out = run_all(engine, [seeded, *others])
        assert engine.spec is not None
        return out["s"].token_ids, engine.spec.num_sampled_steps

    alone, num_whole = run()
    shared, num_shared_whole = run(request("l", ps[1], max_tokens=24, logprobs=True))
    assert num_whole > 0 and num_shared_whole < num_whole  # its steps beside "l": the host path
    assert shared == alone

"""Sampler: compared with transformers' logits processors and the OpenAI penalty formula."""

from __future__ import annotations

import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from backend.engine.sampler import Sampler, SampleRow, apply_penalties, apply_top_k, apply_top_p
from schemas.backend import SamplingParams

V = 50


def row(
    seed: int = 0, prompt: list[int] | None = None, output: list[int] | None = None, **params: object
) -> SampleRow:
    return SampleRow(
        params=SamplingParams(**params),  # type: ignore[arg-type]
        generator=torch.Generator().manual_seed(seed),
        token_ids=(prompt or []) + (output or []),
        num_prompt_tokens=len(prompt or []),
    )


def logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax() -> None:
    x = logits(4)
    scores = Sampler().sample(x, [row(temperature=0.0) for _ in range(4)])
    assert [s.token_id for s in scores] == x.argmax(dim=-1).tolist()


def test_seeded_draws_do_not_depend_on_batch_neighbours() -> None:
    x = logits(1, seed=1)[0]
    sampler = Sampler()
    alone = []
    g_alone = row(seed=1234, temperature=0.9, top_p=0.95)
    for _ in range(20):
        alone.append(sampler.sample(x[None], [g_alone])[0].token_id)
    crowded = []
    target = row(seed=1234, temperature=0.9, top_p=0.95)
    for step in range(20):
        neighbours = [row(seed=step, temperature=1.3, top_k=5) for _ in range(step % 4)]
        batch = torch.cat([logits(len(neighbours), seed=100 + step), x[None]])
        crowded.append(sampler.sample(batch, [*neighbours, target])[-1].token_id)
    assert alone == crowded
    assert len(set(alone)) > 1  # it really samples


def test_top_k_and_top_p_masks_equal_transformers_warpers() -> None:
    x = logits(6, seed=2)
    for k in (1, 3, 17):
        ours = apply_top_k(x, torch.full((6,), k))
        ref = TopKLogitsWarper(top_k=k)(None, x.clone())
        assert torch.equal(ours.isinf(), ref.isinf())
    for p in (0.1, 0.5, 0.9):
        ours = apply_top_p(x, torch.full((6,), p))
        ref = TopPLogitsWarper(top_p=p)(None, x.clone())
        assert torch.equal(ours.isinf(), ref.isinf())


def test_top_k_and_top_p_restrict_the_sampled_support() -> None:
    x = logits(1, seed=3)
    top3 = set(x[0].topk(3).indices.tolist())
    probs = torch.softmax(x[0], dim=-1)
    order = probs.argsort(descending=True)
    nucleus = set(order[: int((probs[order].cumsum(0) < 0.6).sum()) + 1].tolist())
    sampler = Sampler()
    k_row, p_row = row(seed=5, temperature=1.0, top_k=3), row(seed=6, temperature=1.0, top_p=0.6)
    k_draws = {sampler.sample(x, [k_row])[0].token_id for _ in range(200)}
    p_draws = {sampler.sample(x, [p_row])[0].token_id for _ in range(200)}
    assert k_draws == top3
    assert p_draws == nucleus


def test_temperature_sampling_follows_the_softmax() -> None:
    x = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    r = row(seed=7, temperature=0.7)
    counts = torch.zeros(4)
    for _ in range(3000):
        counts[Sampler().sample(x, [r])[0].token_id] += 1
    expected = torch.softmax(x[0] / 0.7, dim=-1)
    assert torch.allclose(counts / 3000, expected, atol=0.03)


def test_repetition_penalty_equals_transformers() -> None:
    x = logits(2, seed=4)
    prompt, output = [1, 2, 3, 2], [7, 3]
    ours = apply_penalties(x.clone(), [row(prompt=prompt, output=output, repetition_penalty=1.7)] * 2)
    ids = torch.tensor([prompt + output] * 2)
    ref = RepetitionPenaltyLogitsProcessor(penalty=1.7)(ids, x.clone())
    torch.testing.assert_close(ours, ref)


def test_frequency_and_presence_penalties_follow_the_openai_formula() -> None:
    x = logits(1, seed=5)
    output = [4, 4, 4, 9, 11, 4]
    ours = apply_penalties(
        x.clone(), [row(prompt=[9, 12], output=output, frequency_penalty=0.5, presence_penalty=1.25)]
    )
    ref = x.clone()
    for j in range(V):
        c = output.count(j)  # mu[j] - c[j] * alpha_frequency - (c[j] > 0) * alpha_presence
        ref[0, j] = x[0, j] - c * 0.5 - float(c > 0) * 1.25
    torch.testing.assert_close(ours, ref)
    assert ours[0, 12] == x[0, 12]  # prompt tokens are not penalised by these two


def test_penalties_change_the_greedy_choice() -> None:
    x = torch.zeros(1, V)
    x[0, 3], x[0, 8] = 2.0, 1.5
    assert Sampler().sample(x, [row(temperature=0.0)])[0].token_id == 3
    assert Sampler().sample(x, [row(temperature=0.0, output=[3], presence_penalty=1.0)])[0].token_id == 8


def test_reported_logprobs_are_the_model_log_softmax() -> None:
    x = logits(3, seed=6)
    rows = [
        row(seed=i, temperature=0.8, logprobs=True, top_logprobs=5, repetition_penalty=1.5, prompt=[1])
        for i in range(3)
    ]
    scores = Sampler().sample(x, rows)
    ref = torch.log_softmax(x, dim=-1)
    for i, s in enumerate(scores):
        assert abs(s.logprob - float(ref[i, s.token_id])) < 1e-6
        top_vals, top_ids = ref[i].topk(5)
        assert [t for t, _ in s.top] == top_ids.tolist()
        assert torch.allclose(torch.tensor([lp for _, lp in s.top]), top_vals)
    prompt_scores = Sampler().score(x, [4, 5, 6], num_top=2)
    assert [s.logprob for s in prompt_scores] == [float(ref[i, t]) for i, t in enumerate([4, 5, 6])]


def test_constraint_mask_is_applied_per_row() -> None:
    x = logits(2, seed=8)
    allowed = torch.zeros(V, dtype=torch.bool)
    allowed[[5, 6]] = True
    constrained = row(seed=1, temperature=1.0)
    constrained.allowed = allowed
    free = row(temperature=0.0)
    for _ in range(30):
        a, b = Sampler().sample(x, [constrained, free])
        assert a.token_id in (5, 6)
        assert b.token_id == int(x[1].argmax())


def test_top_p_one_keeps_the_whole_vocabulary_whatever_its_neighbours_ask() -> None:
    """Float rounding in the cumulative mass must not cut the tail of a row that asked for no top-p
    just because a neighbour in the batch did."""
    x = torch.randn(2, 151_552, generator=torch.Generator().manual_seed(0)) * 3
    kept = apply_top_p(x, torch.tensor([1.0, 0.5]))
    assert torch.equal(kept[0], x[0])
    assert torch.isinf(kept[1]).any()


def test_banned_ids_are_masked_without_touching_the_callers_logits() -> None:
    """A guard's banned ids (a few per row) mask the draw in place, on the sampler's own float32
    copy of bf16 logits or on a clone of float32 ones: the caller's logits, which the log-probs
    read, keep their values."""
    for dtype in (torch.float32, torch.bfloat16):
        x = logits(2, seed=9).to(dtype)
        before = x.clone()
        best = [int(x[i].float().argmax()) for i in range(2)]
        rows = [row(temperature=0.0, logprobs=True), row(seed=3, temperature=0.7, logprobs=True)]
        for r, b in zip(rows, best, strict=True):
            r.banned_ids = (b,)
        greedy, drawn = Sampler().sample(x, rows)
        assert torch.equal(x, before), dtype
        assert greedy.token_id == int(x[0].float().topk(2).indices[1]) and drawn.token_id != best[1]
        raw = torch.log_softmax(x.float(), dim=-1)
        assert abs(greedy.logprob - float(raw[0, greedy.token_id])) < 1e-6

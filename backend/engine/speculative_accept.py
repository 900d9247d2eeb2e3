"""The acceptance rule of speculative decoding: which drafts a verify step keeps.

Row i of a verify step's logits is the target's next-token distribution after the drafts
d_1 … d_i. Greedy rows accept d_{i+1} while it is row i's argmax. Sampled rows accept d_{i+1} with
probability p_i(d_{i+1}), else draw from p_i with d_{i+1} taken out: the speculative sampling rule
(Leviathan et al., 2023) for a deterministic draft, which leaves every emitted token distributed
exactly as p_i, p(d)·1[t=d] + (1 - p(d))·p(t)/(1 - p(d))·1[t≠d] = p(t). p_i is the sampler's own
distribution (`backend.engine.sampler`: penalties over the context with the accepted drafts, temperature,
top-k, top-p). Either way the first rejection emits the target's token, and with every draft
accepted the last row gives one more (the bonus token).

Shape letters: k drafts, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch

from backend.engine.sampler import SampleRow, apply_penalties, apply_top_k, apply_top_p


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens emitted, given the k drafts and the target's k + 1 greedy tokens."""
    a = next((i for i, d in enumerate(drafts) if targets[i] != d), len(drafts))
    return drafts[:a] + [targets[a]]


def accept_sampled(logits: torch.Tensor, drafts: list[int], row: SampleRow) -> list[int]:
    """The tokens emitted, row by row over `logits [k + 1, V]`, drawing with `row`'s generator
    (`row.token_ids`: the context before the first row; temperature 0 with penalties is greedy)."""
    params, gen = row.params, row.generator
    out: list[int] = []
    for i in range(len(drafts) + 1):
        context = SampleRow(params, gen, row.token_ids + drafts[:i], row.num_prompt_tokens)
        x = apply_penalties(logits[i : i + 1].float(), [context])  # [1, V]
        draft = drafts[i] if i < len(drafts) else None
        if params.temperature == 0:
            t = int(x.argmax())
            if t != draft:
                return [*out, t]
            out.append(t)
            continue
        probs = target_probs(x, params)[0]  # [V]
        if draft is not None:
            u = torch.rand((), generator=gen, device=probs.device)
            if bool(u < probs[draft]):
                out.append(draft)
                continue
            probs = probs.clone()
            probs[draft] = 0.0
        noise = torch.empty_like(probs).exponential_(generator=gen)
        return [*out, int((probs / noise).argmax())]  # the Gumbel-max draw, as the sampler's
    raise AssertionError("the last row always emits")


def target_probs(x: torch.Tensor, params: Any) -> torch.Tensor:
    """The sampler's distribution for temperature > 0 over penalized logits `x [n, V]` of one
    request's rows: temperature, then top-k, then top-p, then softmax (as `Sampler._draw`)."""
    n, V = x.shape
    dev = x.device
    xs = x / params.temperature
    if 0 < params.top_k < V:
        xs = apply_top_k(
            xs, torch.full((n,), params.top_k, dtype=torch.int64, device=dev), max_k=params.top_k
        )
    if params.top_p < 1.0:
        xs = apply_top_p(xs, torch.full((n,), params.top_p, dtype=torch.float32, device=dev))
    return torch.softmax(xs, dim=-1)

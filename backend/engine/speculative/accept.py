"""The acceptance rule of speculative decoding: which drafts a verify step keeps.

Row i of a verify step's logits is the target's next-token distribution after the drafts
d_1 … d_i. Greedy rows accept d_{i+1} while it is row i's argmax. Sampled rows accept d_{i+1} with
probability p_i(d_{i+1}), else draw from p_i with d_{i+1} taken out: the speculative sampling rule
(Leviathan et al., 2023) for a deterministic draft, which leaves every emitted token distributed
exactly as p_i, p(d)·1[t=d] + (1 - p(d))·p(t)/(1 - p(d))·1[t≠d] = p(t). p_i is the sampler's own
distribution (`backend.engine.sampler`: penalties over the context with the accepted drafts, temperature,
top-k, top-p). Either way the first rejection emits the target's token, and with every draft
accepted the last row gives one more (the bonus token). A sampled row's random numbers are the
whole step's (backend/engine/speculative/sampled.py `draw_uniforms`, from the request's host
generator, used alike), so a seeded request draws the same tokens whichever path its steps take.

`choose_tokens` applies the rule to every row of a verify step (a plain row samples its one token),
and `token_scores` gives the emitted tokens' log-probs where the request asks for them.

Shape letters: k drafts, N logits rows, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from backend.engine.host_staging import to_device
from backend.engine.model_runner import ModelRunner
from backend.engine.sampler import (
    Sampler,
    SampleRow,
    TokenScore,
    apply_penalties,
    apply_top_k,
    apply_top_p,
    mask_banned,
)
from backend.engine.sequence import Sequence
from backend.engine.speculative.plan import SpecRow
from backend.engine.speculative.sampled import draw_inverse_cdf, draw_uniforms


def choose_tokens(
    rows: list[SpecRow],
    logits: torch.Tensor,
    runner: ModelRunner,
    generator_of: Callable[[Sequence], torch.Generator],
) -> list[list[int]]:
    """The tokens each sequence emits this step, from the verify's `logits [N, V]`: one sampled,
    or its accepted drafts and the target's next token; [] for a row that samples nothing.
    `generator_of`: a sequence's host generator, for its drafts' random numbers (`accept_sampled`)."""
    emitted: list[list[int]] = [[] for _ in rows]
    plain = [b for b, r in enumerate(rows) if r.logits_rows and not r.drafts]
    if plain:
        sample_rows = [runner.sample_row(rows[b].sched.seq) for b in plain]
        index = to_device([rows[b].logits_rows[0] for b in plain], torch.int64, logits.device)
        for b, t in zip(plain, runner.sampler.draw(logits[index], sample_rows).tolist(), strict=True):
            emitted[b] = [t]
    greedy = [b for b, r in enumerate(rows) if r.drafts and r.sched.seq.sample_row.is_argmax]
    if greedy:  # one argmax over every verify row of the greedy sequences, one copy back
        index = to_device([i for b in greedy for i in rows[b].logits_rows], torch.int64, logits.device)
        banned = [ids for b in greedy for ids in banned_rows(rows[b])]
        targets = mask_banned(logits[index], banned).argmax(dim=-1).tolist()
        at = 0
        for b in greedy:
            drafts = rows[b].drafts
            emitted[b] = accept_greedy(drafts, targets[at : at + len(drafts) + 1])
            at += len(drafts) + 1
    for b, r in enumerate(rows):
        if r.drafts and not r.sched.seq.sample_row.is_argmax:
            seq = r.sched.seq
            emitted[b] = accept_sampled(
                logits[r.logits_rows], r.drafts, seq.sample_row, generator_of(seq), banned_rows(r)
            )
    return emitted


def banned_rows(r: SpecRow) -> list[tuple[int, ...]]:
    """The ids banned at each of `r`'s verify rows: its token guard's, along its drafts (row i
    follows d_1 … d_i, which may open or close the block), as one-at-a-time decoding would ban them."""
    guard = r.sched.seq.guard
    return guard.banned_along(r.drafts) if guard is not None else [()] * (len(r.drafts) + 1)


def token_scores(logits: torch.Tensor, r: SpecRow, tokens: list[int], sampler: Sampler) -> list[TokenScore]:
    """The scores of the tokens `r` emitted, from its logits rows (log-probs where it asks)."""
    row = r.sched.seq.sample_row
    if not row.params.logprobs:  # nothing to compute: no copies to the device either
        return [TokenScore(t, None, []) for t in tokens]
    rows = [row] * len(tokens)
    index = to_device(r.logits_rows[: len(tokens)], torch.int64, logits.device)
    chosen = to_device(tokens, torch.int64, logits.device)
    return sampler.scores(logits[index], rows, chosen, tokens)


def accept_greedy(drafts: list[int], targets: list[int]) -> list[int]:
    """The tokens emitted, given the k drafts and the target's k + 1 greedy tokens."""
    a = next((i for i, d in enumerate(drafts) if targets[i] != d), len(drafts))
    return drafts[:a] + [targets[a]]


def accept_sampled(
    logits: torch.Tensor,
    drafts: list[int],
    row: SampleRow,
    gen: torch.Generator,
    banned: list[tuple[int, ...]] | None = None,
) -> list[int]:
    """The tokens emitted, row by row over `logits [k + 1, V]` (`row.token_ids`: the context before
    the first row; temperature 0 with penalties is greedy), with the random numbers a whole step
    would draw from the host generator `gen` (sampled.py: u_i accepts d_{i+1}, v_a draws the token
    at the row a where it stops, by inverse CDF in float64). `banned`: per row, the ids a reasoning
    guard masks there (`banned_rows`)."""
    params, k = row.params, len(drafts)
    uniforms = draw_uniforms(gen, k) if params.temperature != 0 else None  # [2k + 1]: u's, then v's
    out: list[int] = []
    for i in range(k + 1):
        context = SampleRow(params, row.generator, row.token_ids + drafts[:i], row.num_prompt_tokens)
        x = apply_penalties(logits[i : i + 1].float(), [context])  # [1, V]
        if banned is not None and banned[i]:
            x = mask_banned(x.clone(), [banned[i]])  # a copy: `x` may be a view of the verify's logits
        draft = drafts[i] if i < len(drafts) else None
        if params.temperature == 0:
            t = int(x.argmax())
            if t != draft:
                return [*out, t]
            out.append(t)
            continue
        assert uniforms is not None
        probs = target_probs(x, params)[0].double()  # [V]
        if draft is not None:
            if float(uniforms[i]) < float(probs[draft]):
                out.append(draft)
                continue
            probs[draft] = 0.0  # the residual
        v = uniforms[k + i : k + i + 1].to(probs.device)  # [1]
        return [*out, int(draw_inverse_cdf(probs[None], v)[0])]
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

"""Batched sampling: penalties, constraint masks, temperature, top-k, top-p, seeded draws, log-probs.

(DESIGN.md §2 step 7.) Every row has its own `torch.Generator` on the logits' device (seeded from the request's seed, or
from the engine's seed sequence when it has none) and draws its own noise, so a seeded request
samples the same tokens whatever else shares its batch. Sampling is the Gumbel-max form of a
multinomial draw: argmax(p / E) with E ~ Exp(1).

Log-probabilities reported to callers (`logprobs`, `top_logprobs`, prompt log-probs) are those of the
model's own distribution: log_softmax of the raw logits, before penalties, masks and temperature,
which is what evaluation harnesses compare.

Shape letters: N = rows sampled this step, V = vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.engine.host_staging import to_device
from schemas.backend import SamplingParams


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs to know about one row's request. `token_ids` is the sequence's own
    list (prompt, then output), not a copy: only the penalties read it, so a step does not copy
    every sequence's tokens to sample them."""

    params: SamplingParams
    generator: torch.Generator
    token_ids: list[int]
    num_prompt_tokens: int
    allowed: torch.Tensor | None = None  # [V] bool from a TokenConstraint, None = anything
    banned_ids: tuple[
        int, ...
    ] = ()  # from a TokenGuard: end-of-turn ids inside a reasoning block, unoffered markers
    is_argmax: bool = field(init=False)  # greedy with no penalty: the argmax of the (masked) logits

    def __post_init__(self) -> None:
        p = self.params
        self.is_argmax = (
            p.temperature == 0
            and p.repetition_penalty == 1.0
            and not p.frequency_penalty
            and not p.presence_penalty
        )

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]


@dataclass(slots=True)
class TokenScore:
    token_id: int
    logprob: float | None  # None when the request asked for no log-probs (not computed)
    top: list[tuple[int, float]]  # (token id, logprob), best first


class Sampler:
    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[TokenScore]:
        """One token per row of `logits [N, V]`."""
        chosen = self.draw(logits, rows)
        return self.scores(logits, rows, chosen, chosen.tolist())

    def draw(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """`[N]` chosen ids, left on the logits' device: no host sync, so the caller can bring them
        back together with whatever else the step reads (the model runner's one copy per step)."""
        given, logits = logits, logits.float()
        if all(r.is_argmax and r.allowed is None and not r.banned_ids for r in rows):  # plain greedy
            return logits.argmax(dim=-1)
        x = apply_penalties(logits, rows)  # a new tensor when any penalty applies
        if any(r.allowed is not None or r.banned_ids for r in rows):
            # masked in place: a copy only where `x` is still the caller's tensor (float32 logits,
            # no penalty), whose raw values the log-probs read
            x = self._mask_disallowed(x.clone() if x is given else x, rows)
        return self._draw(x, rows)

    def scores(
        self, logits: torch.Tensor, rows: list[SampleRow], chosen: torch.Tensor, chosen_ids: list[int]
    ) -> list[TokenScore]:
        """The rows' `TokenScore`s for `draw`'s `chosen` (on the host as `chosen_ids`), with
        log-probs for the rows that ask for them."""
        scores = [TokenScore(t, None, []) for t in chosen_ids]
        wanted = [i for i, r in enumerate(rows) if r.params.logprobs]
        if wanted:
            index = torch.tensor(wanted, dtype=torch.int64, device=logits.device)
            raw_logprobs = torch.log_softmax(logits[index].float(), dim=-1)  # [n, V]
            tops = [rows[i].params.top_logprobs for i in wanted]
            for i, score in zip(wanted, self._scores(raw_logprobs, chosen[index], tops), strict=True):
                scores[i] = score
        return scores

    def score(self, logits: torch.Tensor, target_ids: list[int], num_top: int) -> list[TokenScore]:
        """Log-probs of given next tokens under `logits [N, V]` (prompt log-probs)."""
        raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        chosen = torch.tensor(target_ids, dtype=torch.int64, device=logits.device)
        return self._scores(raw_logprobs, chosen, [num_top] * len(target_ids))

    # ---- steps ---------------------------------------------------------------------------------
    @staticmethod
    def _mask_disallowed(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """-inf at the tokens the constrained rows' grammars disallow: their host masks stacked and sent in
        one copy (on CUDA pinned and non-blocking, so it does not wait for the step's graph), one fill;
        and at the ids token guards ban (see `mask_banned`)."""
        V = x.shape[1]
        x = mask_banned(x, [() if r.allowed is not None else r.banned_ids for r in rows])
        constrained = [
            (i, with_banned(r.allowed[:V], r.banned_ids)) for i, r in enumerate(rows) if r.allowed is not None
        ]
        if not constrained:
            return x
        allowed = torch.stack([mask for _, mask in constrained])  # [n, V] bool
        if x.device.type == "cuda" and allowed.device.type == "cpu":
            allowed = allowed.pin_memory().to(x.device, non_blocking=True)
        else:
            allowed = allowed.to(x.device)
        index = to_device([i for i, _ in constrained], torch.int64, x.device)
        x[index] = x[index].masked_fill(~allowed, float("-inf"))
        return x

    @staticmethod
    def _draw(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """`[N]` chosen ids: argmax for temperature 0, else a seeded draw from the truncated softmax."""
        N, V = x.shape
        dev = x.device
        drawn = [i for i, r in enumerate(rows) if r.params.temperature != 0]  # on the host: no sync
        if not drawn:
            return x.argmax(dim=-1)
        params = [rows[i].params for i in drawn]
        index = None if len(drawn) == N else to_device(drawn, torch.int64, dev)
        temps = to_device([p.temperature for p in params], torch.float32, dev)  # [n]
        xs = (x if index is None else x[index]) / temps[:, None]  # [n, V]
        if any(0 < p.top_k < V for p in params):
            ks = [p.top_k if 0 < p.top_k <= V else V for p in params]
            xs = apply_top_k(xs, to_device(ks, torch.int64, dev), max_k=max(ks))
        if any(p.top_p < 1.0 for p in params):
            xs = apply_top_p(xs, to_device([p.top_p for p in params], torch.float32, dev))
        probs = torch.softmax(xs, dim=-1)  # [n, V]
        noise = torch.empty_like(probs)  # [n, V]
        for j, i in enumerate(drawn):  # row by row: each its own generator, as many draws as alone
            noise[j].exponential_(generator=rows[i].generator)
        drawn_ids = (probs / noise).argmax(dim=-1)  # [n]
        if index is None:
            return drawn_ids
        chosen = x.argmax(dim=-1)  # [N], the greedy rows'
        chosen[index] = drawn_ids
        return chosen

    @staticmethod
    def _scores(raw_logprobs: torch.Tensor, chosen: torch.Tensor, num_tops: list[int]) -> list[TokenScore]:
        picked = raw_logprobs.gather(1, chosen[:, None])[:, 0].tolist()  # [N]
        max_top = min(max(num_tops, default=0), raw_logprobs.shape[-1])
        top_vals, top_ids = raw_logprobs.topk(max_top, dim=-1) if max_top else (None, None)
        out: list[TokenScore] = []
        for i, k in enumerate(num_tops):
            top: list[tuple[int, float]] = []
            if k and top_ids is not None and top_vals is not None:
                top = list(zip(top_ids[i, :k].tolist(), top_vals[i, :k].tolist(), strict=True))
            out.append(TokenScore(int(chosen[i]), picked[i], top))
        return out


def mask_banned(x: torch.Tensor, banned: list[tuple[int, ...]]) -> torch.Tensor:
    """`x [N, V]` with -inf at each row's `banned` ids (a token guard's: a few per row), in place:
    one small index copy to the device, one fill."""
    pairs = [(i, t) for i, ids in enumerate(banned) for t in ids if t < x.shape[1]]
    if pairs:
        index = to_device([p for pair in pairs for p in pair], torch.int64, x.device).view(-1, 2)  # [n, 2]
        x[index[:, 0], index[:, 1]] = float("-inf")
    return x


def with_banned(allowed: torch.Tensor, banned_ids: tuple[int, ...]) -> torch.Tensor:
    """A grammar's host mask `[V]` with a guard's `banned_ids` taken out too, unless that leaves
    nothing allowed (the grammar then decides: it may only let the request end)."""
    banned = [t for t in banned_ids if t < allowed.shape[0]]
    if not banned:
        return allowed
    both = allowed.clone()
    both[banned] = False
    return both if bool(both.any()) else allowed


def apply_top_k(x: torch.Tensor, k: torch.Tensor, max_k: int | None = None) -> torch.Tensor:
    """Keep each row's `k` largest logits (k = 0: keep all). x `[N, V]`, k `[N]`. `max_k`: the
    largest k after that clamp, known on the host: only the top `max_k` are sorted, not all V."""
    V = x.shape[1]
    k = torch.where((k <= 0) | (k > V), V, k)  # callers skip this op when no row truncates (no sync here)
    if max_k is not None and max_k < V:
        sorted_x = x.topk(max_k, dim=-1).values  # [N, max_k], the same values as a full sort's first
    else:
        sorted_x = x.sort(dim=-1, descending=True).values  # [N, V]
    kth = sorted_x.gather(1, (k - 1)[:, None])  # [N, 1]
    return x.masked_fill(x < kth, float("-inf"))


def apply_top_p(x: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose mass reaches `p` (always the top one)."""
    sorted_x, order = x.sort(dim=-1, descending=True)  # [N, V]
    probs = torch.softmax(sorted_x, dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # [N, V] mass of strictly better tokens
    # rows with p = 1 keep everything: their cumulative mass can round past 1.0 before the tail
    drop_sorted = (mass_before >= p[:, None]) & (p[:, None] < 1.0)
    drop = torch.zeros_like(drop_sorted).scatter(1, order, drop_sorted)
    return x.masked_fill(drop, float("-inf"))


def apply_penalties(x: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """`x` itself when no row has a penalty, else a new tensor. Repetition (HF/CTRL: divide positive logits, multiply negative ones, over prompt and
    output), then frequency and presence (OpenAI: minus f·count and p·[count > 0], output only)."""
    N, V = x.shape
    if any(r.params.repetition_penalty != 1.0 for r in rows):
        seen = torch.zeros(N, V, dtype=torch.bool, device=x.device)  # [N, V]
        for i, r in enumerate(rows):
            if r.token_ids:  # prompt and output
                seen[i, to_device(r.token_ids, torch.int64, x.device)] = True
        rep = to_device([r.params.repetition_penalty for r in rows], torch.float32, x.device)[
            :, None
        ]  # [N, 1]
        x = torch.where(seen, torch.where(x > 0, x / rep, x * rep), x)
    if any(r.params.frequency_penalty or r.params.presence_penalty for r in rows):
        counts = torch.zeros(N, V, device=x.device)  # [N, V]
        for i, r in enumerate(rows):
            output_ids = r.output_ids
            if output_ids:
                out_ids = to_device(output_ids, torch.int64, x.device)
                counts[i].scatter_add_(0, out_ids, torch.ones(len(out_ids), device=x.device))
        freq = to_device([r.params.frequency_penalty for r in rows], torch.float32, x.device)[:, None]
        pres = to_device([r.params.presence_penalty for r in rows], torch.float32, x.device)[:, None]
        x = x - freq * counts - pres * (counts > 0).float()
    return x

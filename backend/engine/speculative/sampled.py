"""A whole sampled speculative step on the device: verify, rejection sampling, propose, one result.

The sampled twin of backend/engine/speculative/greedy.py, for a step where some sequence samples
(temperature > 0) with no penalty and no log-probs: the speculative sampling rule of
backend/engine/speculative/accept.py (`accept_sampled`) on the device, so that the step is one CUDA
graph replay per (k, bucket) (backend/engine/speculative/verify_graphs.py) and one host read, as a
greedy step is. Greedy sequences in the same step keep the greedy rule (argmax), bit for bit.

Per sequence b, row i of its verify (after drafts d_1 … d_i), with p_i the sampler's distribution
there (its token guard's bans as `mask_guarded` sets them, then temperature, top-k, top-p,
softmax: `accept.target_probs`):

1. d_{i+1} is accepted when u_i < p_i(d_{i+1}); a = the number of leading accepted drafts.
2. The token at row a is drawn from p_a with d_{a+1} taken out (the residual; with a = k, from p_k:
   the bonus token), by inverse CDF: the first id whose cumulative mass exceeds v_a times the total.
   Every emitted token is then distributed exactly as the target's (accept.py's module). The CDF
   and the uniforms are float64: in float32 both are spaced 6e-8 near 1, coarser than a large
   vocabulary's tail (tokens of 1e-9 each), which would then be drawn by the wrong weights.
3. The drafts after it: `greedy.draft_on_device`, over the tokens d_1 … d_a and the drawn one.

The random numbers u_0 … u_{k−1} and v_0 … v_k are drawn on the host from the request's generator
(`draw_rows`) and cross with the step's other inputs in its one copy: a replay reads fresh ones
from its static buffer, every tensor-parallel rank reads the same, and nothing in the graph touches
an RNG state. A row of `draw_rows`, `[3 + 2k + 1]` float64: temperature (0: the greedy rule), top-k
(0: off), top-p, the k u's, the k + 1 v's.

Shape letters: B sequences, L = k + 1 rows each, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from backend.engine.forward_batch import ForwardBatch
from backend.engine.sampler import SampleRow, apply_top_k, apply_top_p
from backend.engine.speculative.greedy import draft_on_device
from kernels.verify_accept import accepted_count, mask_guarded

PARAMS_WIDTH = 3  # temperature, top-k, top-p


def draw_width(k: int) -> int:
    """Columns of a `draw_rows` row for k drafts: the sampling parameters, k u's, k + 1 v's."""
    return PARAMS_WIDTH + 2 * k + 1


def can_sample_on_device(row: SampleRow) -> bool:
    """A row whose speculative steps may run here: no penalty (they read the accepted context on
    the host) and no log-probs (reported from the host path's scores)."""
    p = row.params
    return (
        p.repetition_penalty == 1.0
        and not p.frequency_penalty
        and not p.presence_penalty
        and not p.logprobs
        and row.allowed is None
    )


def draw_rows(rows: list[SampleRow], generators: list[torch.Generator], k: int) -> np.ndarray:
    """`[B, draw_width(k)]` float64: each sequence's sampling parameters (float32 values, as the
    host sampler uses them) and this step's uniforms, drawn from its host generator (a greedy row
    draws none: its uniforms stay 0)."""
    out = np.zeros((len(rows), draw_width(k)), dtype=np.float64)
    for b, (row, gen) in enumerate(zip(rows, generators, strict=True)):
        p = row.params
        out[b, :PARAMS_WIDTH] = np.array([p.temperature, p.top_k, p.top_p], dtype=np.float32)
        if p.temperature > 0:
            out[b, PARAMS_WIDTH:] = draw_uniforms(gen, k).numpy()
    return out


def draw_uniforms(gen: torch.Generator, k: int) -> torch.Tensor:
    """`[2k + 1]` float64 in [0, 1) from the host generator `gen`: one sampled sequence's u's and
    v's for a verify of k drafts. The host path (accept.py `accept_sampled`) draws the same ones
    as a whole step here, so a seeded request's tokens do not depend on which path a step took."""
    return torch.rand(2 * k + 1, generator=gen, dtype=torch.float64)


def draw_inverse_cdf(weights: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """`[N]` ids: per row of `weights [N, V]` (float64, not normalised), the first id whose
    cumulative weight exceeds `v [N]` (in [0, 1)) times the row's total; an id of weight 0 never."""
    cdf = weights.cumsum(dim=-1)  # [N, V]
    drawn = torch.searchsorted(cdf, v[:, None] * cdf[:, -1:], right=True)[:, 0]  # [N]
    return torch.where(drawn < weights.shape[1], drawn, weights.argmax(dim=-1))  # v·total rounded up


def sampled_step(
    model: Any, batch: ForwardBatch, guards: torch.Tensor, draws: torch.Tensor, k: int, page_size: int
) -> torch.Tensor:
    """As `greedy.greedy_step`, with `draws [B, draw_width(k)]` (`draw_rows`): `[B, 3 + 2k]`
    int64 per sequence: a, the tokens of rows 0 … k (exact up to row a), the k next drafts, its
    tag flag."""
    L = k + 1
    B = batch.seq_lens.shape[0]
    step = model.build_step(batch)  # the verify's, and depth 0's (the same rows)
    logits, hidden = model.forward_spec(batch, step)  # [B·L, V], [B·L, H]
    V = logits.shape[1]
    drafts = batch.input_ids.view(B, L)[:, 1:]  # [B, k]
    x = mask_guarded(logits, guards).float()  # [B·L, V]
    targets = x.argmax(dim=-1).view(B, L)  # [B, L] the greedy rule's
    params = draws[:, :PARAMS_WIDTH].float()  # [B, 3] as the host sampler's (float32)
    temperature, top_k, top_p = (params[:, i : i + 1].expand(B, L).reshape(B * L) for i in range(3))
    is_sampled = params[:, 0] > 0  # [B]
    xs = x / torch.where(temperature > 0, temperature, 1.0)[:, None]  # [B·L, V]
    xs = apply_top_k(xs, top_k.to(torch.int64))  # top-k 0 (off) keeps every id
    xs = apply_top_p(xs, top_p)
    probs = torch.softmax(xs, dim=-1).view(B, L, V)
    u = draws[:, PARAMS_WIDTH : PARAMS_WIDTH + k]  # [B, k] float64
    v = draws[:, PARAMS_WIDTH + k :]  # [B, L] float64
    is_accepted = u < probs[:, :k].gather(2, drafts[:, :, None])[:, :, 0].double()  # [B, k]
    accepted = torch.where(
        is_sampled, is_accepted.to(torch.int64).cumprod(dim=1).sum(dim=1), accepted_count(targets, drafts)
    )  # [B] a
    # row a's residual: p_a without d_{a+1} (a < k), or p_k (the bonus)
    seqs = torch.arange(B, device=drafts.device)  # [B]
    residual = probs[seqs, accepted].double()  # [B, V]
    rejected = torch.nn.functional.pad(drafts, (0, 1))[seqs, accepted]  # [B] d_{a+1} (0 past d_k)
    kept = torch.where(accepted < k, 0.0, residual.gather(1, rejected[:, None])[:, 0])  # [B]
    residual.scatter_(1, rejected[:, None], kept[:, None])
    drawn = draw_inverse_cdf(residual, v.gather(1, accepted[:, None])[:, 0])  # [B]
    final = torch.where(is_sampled[:, None], drawn[:, None], targets)  # [B, L] row a's token if a stops there
    before = torch.arange(L, device=drafts.device)[None, :] < accepted[:, None]  # [B, L] rows < a
    tokens = torch.where(before, torch.nn.functional.pad(drafts, (0, 1)), final)  # [B, L]
    proposed = draft_on_device(model, batch, hidden, tokens, accepted, page_size, step)  # k × [B, 1]
    flags = batch.tag_mismatch[:, None].to(torch.int64)  # [B, 1] every forward's, read last
    return torch.cat([accepted[:, None], tokens, *proposed, flags], dim=1)  # [B, 3 + 2k]

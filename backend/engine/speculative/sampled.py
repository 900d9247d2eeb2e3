"""A whole sampled speculative step on the device: verify, rejection sampling, propose, one result.

The sampled twin of backend/engine/speculative/greedy.py, for a step where some sequence samples
(temperature > 0) with no penalty and no log-probs: the speculative sampling rule of
backend/engine/speculative/accept.py (`accept_sampled`) on the device, so that the step is one CUDA
graph replay per (k, bucket) (backend/engine/speculative/verify_graphs.py) and one host read, as a
greedy step is. Greedy sequences in the same step keep the greedy rule (argmax), bit for bit.

Per sequence b, row i of its verify (after drafts d_1 … d_i), with p_i the sampler's distribution
there (its reasoning guard's bans as `mask_guarded` sets them, then temperature, top-k, top-p,
softmax: `accept.target_probs`):

1. d_{i+1} is accepted when u_i < p_i(d_{i+1}); a = the number of leading accepted drafts.
2. The token at row a is drawn from p_a with d_{a+1} taken out (the residual; with a = k, from p_k:
   the bonus token), by inverse CDF: the first id whose cumulative mass exceeds v_a times the total.
   Every emitted token is then distributed exactly as the target's (accept.py's module).
3. The drafts after it: `greedy.draft_on_device`, over the tokens d_1 … d_a and the drawn one.

The random numbers u_0 … u_{k−1} and v_0 … v_k are drawn on the host from the request's generator
(`draw_rows`) and cross with the step's other inputs in its one copy: a replay reads fresh ones
from its static buffer, every tensor-parallel rank reads the same, and nothing in the graph touches
an RNG state. A row of `draw_rows`, `[3 + 2k + 1]` float32: temperature (0: the greedy rule), top-k
(0: off), top-p, the k u's, the k + 1 v's.

Shape letters: B sequences, L = k + 1 rows each, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from backend.engine.forward_batch import ForwardBatch
from backend.engine.sampler import SampleRow, apply_top_k, apply_top_p
from backend.engine.speculative.greedy import accepted_count, draft_on_device, mask_guarded

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
    """`[B, draw_width(k)]` float32: each sequence's sampling parameters and this step's uniforms,
    drawn from its host generator (a greedy row draws none: its uniforms stay 0)."""
    out = np.zeros((len(rows), draw_width(k)), dtype=np.float32)
    for b, (row, gen) in enumerate(zip(rows, generators, strict=True)):
        p = row.params
        out[b, :PARAMS_WIDTH] = p.temperature, p.top_k, p.top_p
        if p.temperature > 0:
            torch.rand(2 * k + 1, generator=gen, out=torch.from_numpy(out[b, PARAMS_WIDTH:]))  # [0, 1)
    return out


def sampled_step(
    model: Any, batch: ForwardBatch, guards: torch.Tensor, draws: torch.Tensor, k: int, page_size: int
) -> torch.Tensor:
    """As `greedy.greedy_step`, with `draws [B, draw_width(k)]` (`draw_rows`): `[B, 3 + 2k]`
    int64 per sequence: a, the tokens of rows 0 … k (exact up to row a), the k next drafts, its
    tag flag."""
    L = k + 1
    B = batch.seq_lens.shape[0]
    logits, hidden = model.forward_spec(batch)  # [B·L, V], [B·L, H]
    V = logits.shape[1]
    drafts = batch.input_ids.view(B, L)[:, 1:]  # [B, k]
    x = mask_guarded(logits, drafts, guards).float()  # [B·L, V]
    targets = x.argmax(dim=-1).view(B, L)  # [B, L] the greedy rule's
    temperature, top_k, top_p = (draws[:, i : i + 1].expand(B, L).reshape(B * L) for i in range(3))
    is_sampled = draws[:, 0] > 0  # [B]
    xs = x / torch.where(temperature > 0, temperature, 1.0)[:, None]  # [B·L, V]
    xs = apply_top_k(xs, top_k.to(torch.int64))  # top-k 0 (off) keeps every id
    xs = apply_top_p(xs, top_p)
    probs = torch.softmax(xs, dim=-1).view(B, L, V)
    u = draws[:, PARAMS_WIDTH : PARAMS_WIDTH + k].to(probs.dtype)  # [B, k]
    v = draws[:, PARAMS_WIDTH + k :].to(probs.dtype)  # [B, L]
    is_accepted = u < probs[:, :k].gather(2, drafts[:, :, None])[:, :, 0]  # [B, k]
    residual = probs.clone()
    residual[:, :k].scatter_(2, drafts[:, :, None], 0.0)  # [B, L, V] row i without d_{i+1}
    cdf = residual.cumsum(dim=-1)  # [B, L, V]
    point = (v * cdf[:, :, -1])[:, :, None]  # [B, L, 1]
    drawn = torch.searchsorted(cdf, point, right=True)[:, :, 0]  # [B, L]
    drawn = torch.where(drawn < V, drawn, residual.argmax(dim=-1))  # v·total rounded up to the total
    accepted = torch.where(
        is_sampled, is_accepted.to(torch.int64).cumprod(dim=1).sum(dim=1), accepted_count(targets, drafts)
    )  # [B] a
    final = torch.where(is_sampled[:, None], drawn, targets)  # [B, L] each row's token if a stops there
    before = torch.arange(L, device=drafts.device)[None, :] < accepted[:, None]  # [B, L] rows < a
    tokens = torch.where(before, torch.nn.functional.pad(drafts, (0, 1)), final)  # [B, L]
    proposed = draft_on_device(model, batch, hidden, tokens, accepted, page_size)  # [B, k]
    flags = batch.tag_mismatch[:, None].to(torch.int64)  # [B, 1] every forward's, read last
    return torch.cat([accepted[:, None], tokens, proposed, flags], dim=1)  # [B, 3 + 2k]

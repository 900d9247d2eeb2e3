"""A whole greedy speculative step on the device: verify, accept, propose, one result tensor.

When every sequence of a speculative step verifies the same k drafts greedily (no sampling, no
penalties, no logprobs: backend/engine/speculative/decoder.py decides), nothing between its forwards
needs the host: the acceptance is an argmax and a comparison, and the next forwards' inputs follow
from the accepted length. `greedy_step` runs it all as one function of device tensors, so that a CUDA
graph per (k, batch-size bucket) replays it (backend/engine/speculative/verify_graphs.py) and the host
reads one small tensor back; on the CPU (or wherever no graph was captured) the same function runs eagerly.

Per sequence b (rows b·L … b·L+k of the verify, L = k + 1, positions p … p+k, p its newest token's):

1. Verify: the target over `[newest, d_1 … d_k]`; row i's argmax t_i is its token after d_1 … d_i,
   its token guard's ids masked first (end-of-turn ones where the block is open at row i;
   `kernels/verify_accept.py`, two launches on CUDA for steps 1 and 2, with the ids `TokenGuard.banned_along` the drafts bans at each row, `guard_rows`: the host
   knows the drafts), so the targets are the host path's (accept.py `banned_rows`).
2. Accept: a = the number of leading drafts equal to the target's (d_{i+1} == t_i); the step emits
   t_0 … t_a (the accepted drafts are the targets they equal, then the target's own token).
3. Depth 0: the MTP layer over the same L rows, its input tokens t_0 … t_k (row i's input is the
   token after position p+i: t_i for i <= a; rows past a write MTP KV at positions the next step
   rewrites before any query reads them, as the host path's padding rows do), keeping row a's
   logits and hidden state: the first draft.
4. Depths 1 … k−1: one row each at position p+a+d, its input the previous depth's draft, its KV slot
   read from the page table on the device (pages for n + 2k − 1 tokens are reserved before the
   step, so they are in the table: `page_size` is the block manager's, the slots' unit).

Depth 0 runs over the verify's rows, so it shares the verify's per-forward facts (`Step`: rotary
cos/sin, each row's page tag; `model.build_step`), and the depths 1 … k−1 get theirs for all depths
at once (positions, slots, tags, cos/sin: one op each, not one per depth): a captured step is a graph
node per launch, and these were 22 of a depth's ~86 (GLM nano, k = 3: 532 launches, 176 of a plain
decode step's 177, 2026-12-05).

Every forward ORs into the one `tag_mismatch` [B], so a page that changed owner under any of them
flags its sequence. The result `[B, 3 + 2k]` int64 per sequence: a, t_0 … t_k, the k next drafts,
and its tag flag last (the host's one read back holds it all).

The guard's input is each verify row's banned ids, `guard_rows` (`[B, L, MAX_BANNED]` int64, -1
padded), staged with the step's other inputs: the host walks the guard along the drafts it sent
(four launches in the graph; walking it there from the markers took seventeen at k = 3). The drafts
are proposals and stay unmasked (exactness needs only the targets masked; an end-of-turn draft inside
the block is rejected like any other wrong one).

Shape letters: B sequences, L = k + 1 rows each, V vocabulary, H hidden.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from backend.engine.constraint import TokenGuard
from backend.engine.forward_batch import ForwardBatch
from kernels.draft_rows import DraftRowsArgs, draft_rows
from kernels.verify_accept import VerifyAcceptArgs, verify_accept

if TYPE_CHECKING:
    from backend.models.layers.step import Step

# the most ids a guard may ban on the device: end-of-turn (GLM's are 3, Kimi K2's 2) and unoffered
# tool-call markers (GLM's 6, Kimi's 5); a request with more runs its speculative steps on the host path
MAX_BANNED = 12


def greedy_step(
    model: Any, batch: ForwardBatch, guards: torch.Tensor, k: int, page_size: int
) -> torch.Tensor:
    """`batch`: a uniform verify (B sequences of k + 1 rows, every row a logits row) whose page
    tables hold the pages of n + 2k − 1 tokens; `guards` `[B, k + 1, MAX_BANNED]` its rows'
    `guard_rows`. Returns `[B, 3 + 2k]` int64 (see the module)."""
    step = model.build_step(batch)  # the verify's, and depth 0's (the same rows)
    logits, hidden = model.forward_spec(batch, step)  # [B·L, V], [B·L, H]
    # t_0 … t_k, a and each sequence's row of its last accepted position (two launches on CUDA)
    tail = verify_accept(VerifyAcceptArgs(logits, guards, batch.input_ids, batch.query_start))
    targets, accepted = tail.targets, tail.accepted  # [B, L], [B]
    proposed = draft_on_device(
        model, batch, hidden, targets, accepted, page_size, step, tail.last
    )  # k × [B, 1]
    flags = batch.tag_mismatch[:, None].to(torch.int64)  # [B, 1] every forward's, read last
    return torch.cat([accepted[:, None], targets, *proposed, flags], dim=1)  # [B, 3 + 2k]


def draft_on_device(
    model: Any,
    batch: ForwardBatch,
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    accepted: torch.Tensor,
    page_size: int,
    step: Step | None = None,
    last: torch.Tensor | None = None,
) -> list[torch.Tensor]:
    """Steps 3 and 4 of the module: the next k drafts, per depth `[B, 1]` (columns of the step's
    result: one concatenation, no stack first), after a verify `batch` of B
    sequences of k + 1 rows (uniform: `query_start` b·L, `logits_indices` every row in order), its
    hidden states `hidden [B·L, H]`, each row's next token `tokens [B, L]` (exact up to row a) and
    the accepted counts `accepted [B]` (a). `step`: the verify's `model.build_step(batch)`, which
    depth 0 shares (None: built for it); `last [B]`: `query_start[b] + a` when the caller has it."""
    B, L = tokens.shape
    k = L - 1
    rows = batch.logits_indices[:B]  # [B] 0 … B−1: the uniform verify's first rows (no launch)
    if last is None:  # [B] each sequence's row of its last accepted position
        last = batch.query_start[:B] + accepted
    depth0 = dataclasses.replace(
        batch, input_ids=tokens.reshape(-1), logits_indices=last, logits_are_rows=False
    )
    # a verify's rows follow their sequence's first token: none is at position 0 (real or padding
    # row: a padding sequence's rows are never read)
    draft_logits, g = model.forward_mtp(depth0, hidden, 0, step, past_position_zero=True)  # [B, V], [B·L, H]
    g = g[last]  # [B, H]
    proposed = [draft_logits.argmax(dim=-1, keepdim=True)]  # per depth [B, 1]
    if k > 1:
        # depths 1 … k−1 at once, depth-major [k−1, B]: depth d's row at position p + a + d (one
        # launch on CUDA for their positions, slots, tags and lengths)
        chain = draft_rows(
            DraftRowsArgs(
                batch.positions.view(B, L)[:, 0].long(), accepted, batch.page_table,
                batch.expected_tags if batch.check_tags else None, page_size, k - 1, batch.seq_lens.dtype,
            )
        )  # fmt: skip
        positions, slots, tags, seq_lens = chain.positions, chain.slots, chain.tags, chain.seq_lens
        cos, sin = (t.view(k - 1, B, -1) for t in model.cos_sin(positions.view(-1)))  # [k−1, B, Dr]
        query_start = torch.arange(B + 1, dtype=batch.query_start.dtype, device=rows.device)
        for depth in range(1, k):
            i = depth - 1
            chained = dataclasses.replace(
                batch,
                input_ids=proposed[-1].view(B),
                positions=positions[i],
                query_start=query_start,
                seq_lens=seq_lens[i],
                slot_mapping=slots[i],
                logits_indices=rows,
                logits_are_rows=True,  # rows 0 … B − 1: one a sequence
                seq_index=rows,
                is_decode_only=True,
            )
            chained_step = model.build_step(chained, (cos[i], sin[i]), None if tags is None else tags[i])
            draft_logits, g = model.forward_mtp(chained, g, depth, chained_step)  # [B, V], [B, H]
            proposed.append(draft_logits.argmax(dim=-1, keepdim=True))
    return proposed


def guard_rows(guards: list[TokenGuard | None], drafts: list[list[int]], vocab_size: int) -> np.ndarray:
    """`[B, k + 1, MAX_BANNED]` int64: the ids each sequence's guard bans at each of its verify
    rows (`TokenGuard.banned_along` its k `drafts`, the host path's `banned_rows`), -1 padded;
    ids past the vocabulary dropped, as the sampler's `mask_banned` skips them (no guard: none)."""
    L = len(drafts[0]) + 1 if drafts else 1
    rows = np.full((len(guards), L, MAX_BANNED), -1, dtype=np.int64)
    for b, (guard, ds) in enumerate(zip(guards, drafts, strict=True)):
        if guard is None:
            continue
        assert guard.max_banned <= MAX_BANNED, "more banned ids than a guard row holds"
        for i, banned in enumerate(guard.banned_along(ds)):
            ids = [t for t in banned if 0 <= t < vocab_size]
            rows[b, i, : len(ids)] = ids
    return rows

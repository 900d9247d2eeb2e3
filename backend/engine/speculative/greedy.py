"""A whole greedy speculative step on the device: verify, accept, propose, one result tensor.

When every sequence of a speculative step verifies the same k drafts greedily (no sampling, no
penalties, no logprobs: backend/engine/speculative/decoder.py decides), nothing between its forwards
needs the host: the acceptance is an argmax and a comparison, and the next forwards' inputs follow
from the accepted length. `greedy_step` runs it all as one function of device tensors, so that a CUDA
graph per (k, batch-size bucket) replays it (backend/engine/speculative/verify_graphs.py) and the host
reads one small tensor back; on the CPU (or wherever no graph was captured) the same function runs eagerly.

Per sequence b (rows b·L … b·L+k of the verify, L = k + 1, positions p … p+k, p its newest token's):

1. Verify: the target over `[newest, d_1 … d_k]`; row i's argmax t_i is its token after d_1 … d_i.
2. Accept: a = the number of leading drafts equal to the target's (d_{i+1} == t_i); the step emits
   t_0 … t_a (the accepted drafts are the targets they equal, then the target's own token).
3. Depth 0: the MTP layer over the same L rows, its input tokens t_0 … t_k (row i's input is the
   token after position p+i: t_i for i <= a; rows past a write MTP KV at positions the next step
   rewrites before any query reads them, as the host path's padding rows do), keeping row a's
   logits and hidden state: the first draft.
4. Depths 1 … k−1: one row each at position p+a+d, its input the previous depth's draft, its KV slot
   read from the page table on the device (pages for n + 2k − 1 tokens are reserved before the
   step, so they are in the table: `page_size` is the block manager's, the slots' unit).

Every forward ORs into the one `tag_mismatch` [B], so a page that changed owner under any of them
flags its sequence. The result `[B, 3 + 2k]` int64 per sequence: a, t_0 … t_k, the k next drafts,
and its tag flag last (the host's one read back holds it all).

Shape letters: B sequences, L = k + 1 rows each, V vocabulary, H hidden.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from backend.engine.forward_batch import ForwardBatch


def greedy_step(model: Any, batch: ForwardBatch, k: int, page_size: int) -> torch.Tensor:
    """`batch`: a uniform verify (B sequences of k + 1 rows, every row a logits row) whose page
    tables hold the pages of n + 2k − 1 tokens. Returns `[B, 3 + 2k]` int64 (see the module)."""
    L = k + 1
    B = batch.seq_lens.shape[0]
    logits, hidden = model.forward_spec(batch)  # [B·L, V], [B·L, H]
    targets = logits.argmax(dim=-1).view(B, L)  # [B, L]
    drafts = batch.input_ids.view(B, L)[:, 1:]  # [B, k]
    accepted = accepted_count(targets, drafts)  # [B] a
    rows = torch.arange(B, device=targets.device)  # [B]
    last = rows * L + accepted  # [B] each sequence's row of its last accepted position
    depth0 = dataclasses.replace(batch, input_ids=targets.reshape(-1), logits_indices=last)
    draft_logits, g = model.forward_mtp(depth0, hidden, 0)  # [B, V], [B·L, H]
    g = g[last]  # [B, H]
    proposed = [draft_logits.argmax(dim=-1)]  # per depth [B]
    if k > 1:
        first = batch.positions.view(B, L)[:, 0] + accepted  # [B] the last accepted position
        query_start = torch.arange(B + 1, dtype=batch.query_start.dtype, device=rows.device)
        for depth in range(1, k):
            positions = first + depth  # [B]
            page = batch.page_table.gather(1, (positions // page_size)[:, None])[:, 0].to(torch.int64)
            chained = dataclasses.replace(
                batch,
                input_ids=proposed[-1],
                positions=positions,
                query_start=query_start,
                seq_lens=(positions + 1).to(batch.seq_lens.dtype),
                slot_mapping=page * page_size + positions % page_size,
                logits_indices=rows,
                seq_index=rows,
                is_decode_only=True,
            )
            draft_logits, g = model.forward_mtp(chained, g, depth)  # [B, V], [B, H]
            proposed.append(draft_logits.argmax(dim=-1))
    flags = batch.tag_mismatch[:, None].to(torch.int64)  # [B, 1] every forward's, read last
    return torch.cat([accepted[:, None], targets, torch.stack(proposed, dim=1), flags], dim=1)  # [B, 3 + 2k]


def accepted_count(targets: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """[B] int64: how many leading drafts `[B, k]` equal the target's tokens `[B, k + 1]` before
    them (backend/engine/speculative/accept.py `accept_greedy`, on the device)."""
    k = drafts.shape[1]
    return (targets[:, :k] == drafts).to(torch.int64).cumprod(dim=1).sum(dim=1)

"""The propose step of speculative decoding: the MTP layer drafts each sequence's next tokens.

Depth 0 runs the MTP layer over the positions just accepted (their target hidden states, the rows
of the verify forward, and the tokens that follow them), which also keeps its own KV complete, and
its last row's argmax is the next d_1. It runs over a catching-up sequence's gap too (the verify
recomputed it), and over the chunk of every sequence in the step that does not draft now but may
later and whose MTP KV is whole up to it (a mid-prompt chunk, a plain decode): no drafts for those,
only their MTP KV (backend/engine/speculative/book.py); depths 2 … k chain one token each on the MTP's own hidden
state, their input tokens the previous depth's drafts on the device. The host then reads every
depth's drafts and tag flags back in one copy.

Shape letters: P rows of a draft forward.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from backend.engine.block_manager import BlockManager
from backend.engine.model_runner import ModelRunner, SeqResult
from backend.engine.ranks import SpecForward, StepInputs
from backend.engine.sequence import Sequence
from backend.engine.speculative.plan import SpecRow, host_batch

Forward = Callable[[StepInputs], tuple[torch.Tensor, torch.Tensor]]  # (logits, tag flags [B])


def propose(
    rows: list[SpecRow],
    results: list[SeqResult],
    emitted: list[list[int]],
    k: int,
    *,
    runner: ModelRunner,
    block_manager: BlockManager,
    forward: Forward,
    keeps_draft_kv: list[bool],
) -> tuple[dict[int, list[int]], list[int]]:
    """Run the MTP layer over each drafting sequence's new positions (and gap) and chain its
    drafts: depth 0 over the accepted positions (every verify row, padded, when each sequence
    verified k drafts: one graph's shape), depths 1 … k−1 one row each, their input tokens the
    previous depth's drafts on the device; then one copy back of every depth's drafts and tag
    flags. Depth 0 also writes the MTP KV of each row with `keeps_draft_kv` whose MTP KV is whole
    up to its chunk, drafting or not. Advances `num_draft_kv_tokens` of every sequence it covered.

    Flags `results` whose draft read or wrote a page that changed owner. Returns the drafts by
    sequence index (those not flagged), and each draft forward's number of rows (for the policy's
    timing)."""
    accepted = []  # (b, first position, m: target rows whose next token is now known, the tokens after)
    for b, r in enumerate(rows):
        seq, tokens = r.sched.seq, emitted[b]
        start = seq.num_computed_tokens - r.gap
        if (
            results[b].is_tag_mismatch
            or (r.sched.needs_sample and not tokens)
            or not (r.is_drafting or (keeps_draft_kv[b] and seq.num_draft_kv_tokens == start))
        ):
            continue
        m = r.gap + results[b].num_new_tokens
        # the tokens after positions start … start+m-1: the gap's and chunk's own, then what was emitted
        accepted.append((b, start, m, (seq.token_ids[start + 1 : start + m + 1] + tokens)[:m]))
    draft_rows: list[int] = []
    if not accepted:
        return {}, draft_rows
    # each verified k drafts: its k + 1 verify rows exist, and depth 0 runs over all of them
    width = k + 1 if k and all(len(rows[b].drafts) == k and not rows[b].gap for b, *_ in accepted) else 0
    items: list[tuple[Sequence, int, list[int]]] = []
    owners: list[int] = []
    hidden_rows: list[int] = []
    logits_indices: list[int] = []
    proposing = []  # (b, drafts to propose, the last position the MTP layer ran at)
    for b, start, m, after in accepted:
        r = rows[b]
        seq = r.sched.seq
        remaining = seq.request.sampling.max_tokens - (seq.num_output_tokens + len(emitted[b]))
        num_drafts = min(k, remaining - 1) if r.is_drafting else 0
        if num_drafts > 0:
            proposing.append((b, num_drafts, start + m - 1))
            logits_indices.append(len(hidden_rows) + m - 1)
        n = width or m
        items.append((seq, start, after + [0] * (n - m)))  # padding rows: rewritten before read
        owners.append(b)
        hidden_rows += range(r.base, r.base + n)
    host = host_batch(block_manager, items, logits_indices)
    draft_rows.append(len(hidden_rows))
    _, flags = forward(StepInputs(host, spec=SpecForward(0, np.array(hidden_rows, dtype=np.int64))))
    flagged = [(owners, flags)]  # (sequences, their flags [n]) per forward
    depth_rows = [list(range(len(proposing)))]  # per depth, the proposing rows it drafted for
    for depth in range(1, k):
        live = [i for i, (_, n, _) in enumerate(proposing) if n > depth]
        if not live:
            break
        chain = [(rows[proposing[i][0]].sched.seq, proposing[i][2] + depth, [0]) for i in live]
        host_k = host_batch(block_manager, chain, list(range(len(live))))  # input tokens: on the device
        draft_rows.append(len(live))
        spec = SpecForward(depth, np.array(live, dtype=np.int64), chain=True)
        _, flags_k = forward(StepInputs(host_k, spec=spec))
        flagged.append(([proposing[i][0] for i in live], flags_k))
        depth_rows.append(live)
    assert runner.spec_forwards is not None
    drafted = runner.spec_forwards.drafted  # per depth [len(depth_rows[d])], on this rank
    values = torch.cat([t.to(torch.int64) for t in (*drafted, *(f for _, f in flagged))]).tolist()
    drafts: list[list[int]] = [[] for _ in proposing]
    at = 0
    for live in depth_rows:
        for i in live:
            drafts[i].append(values[at])
            at += 1
    for seqs, _ in flagged:
        for b in seqs:
            # a draft read or write of a page that changed owner
            results[b].is_tag_mismatch |= bool(values[at])
            at += 1
    for b, start, m, _ in accepted:
        if not results[b].is_tag_mismatch:
            rows[b].sched.seq.wrote_draft_kv(start + m)
    proposed = {b: drafts[i] for i, (b, _, _) in enumerate(proposing) if not results[b].is_tag_mismatch}
    return proposed, draft_rows

"""The host inputs of a speculative step's forwards: which tokens each runs at which positions.

A step's rows (`SpecRow`, one per scheduled sequence) carry the drafts it verifies and, once planned,
where its rows sit in the verify forward. `plan_target` lays out the verify forward (each sequence's
chunk, a drafting decode's drafts after its newest token), `plan_greedy` the same for a whole greedy
step, vectorised, and `host_batch` any forward of `(sequence, first position, tokens)` chunks over
the sequences' pages (the propose step's too: backend/engine/speculative/propose.py).

Shape letters: B sequences, T tokens of a forward, L = k + 1 verify rows per sequence, S page size.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from backend.engine.block_manager import BlockManager
from backend.engine.forward_batch import HostBatch
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence
from backend.engine.speculative.greedy import guard_rows
from backend.engine.step_planner import StepPlanner


@dataclass(slots=True)
class SpecRow:
    """One scheduled sequence's part of a speculative step."""

    sched: ScheduledSeq
    is_drafting: bool
    drafts: list[int] = field(default_factory=list)  # verified this step
    gap: int = 0  # MTP KV catch-up: positions before its chunk that the verify recomputes
    base: int = 0  # its first row of T (its gap's first position)
    logits_rows: list[int] = field(default_factory=list)  # verify rows, or [sample row]


def plan_greedy(rows: list[SpecRow], k: int, block_manager: BlockManager, vocab_size: int) -> HostBatch:
    """A greedy step's verify, vectorised: each sequence's newest token and its k drafts at
    positions n-1 … n-1+k, its page table as wide as the chained drafts need (n + 2k - 1
    tokens), and the ids its token guard bans at each row (those under `vocab_size`)."""
    L, S, B = k + 1, block_manager.page_size, len(rows)
    seqs = [r.sched.seq for r in rows]
    tokens = np.array(
        [[seq.token_ids[-1], *r.drafts] for seq, r in zip(seqs, rows, strict=True)], dtype=np.int64
    )  # [B, L]
    # per sequence: its first position n-1, its table's row and length, its pages for n + 2k - 1 tokens
    starts, table_rows, lengths, num_pages = np.array(
        [
            (
                seq.num_computed_tokens,
                seq.page_table.row,
                seq.page_table.length,
                (seq.num_computed_tokens + L + k - 2) // S + 1,
            )
            for seq in seqs
        ],
        dtype=np.int64,
    ).T  # [B] each
    positions = starts[:, None] + np.arange(L)  # [B, L]
    ids, tags = block_manager.page_tables.gather(table_rows, lengths, num_pages)
    slots = ids[np.arange(B)[:, None], positions // S] * np.int64(S) + positions % S  # [B, L]
    rows_of = np.arange(B * L)  # [B·L] every row a logits row
    return HostBatch(
        input_ids=tokens.reshape(-1),
        positions=positions.reshape(-1),
        slots=slots.reshape(-1),
        seq_index=rows_of // L,
        query_start=np.arange(0, B * L + 1, L, dtype=np.int32),
        seq_lens=(starts + L).astype(np.int32),
        logits_indices=rows_of,
        page_table=ids,
        expected_tags=tags,
        rows_per_seq=L,
        guards=guard_rows([seq.guard for seq in seqs], [r.drafts for r in rows], vocab_size),
    )


def plan_target(
    rows: list[SpecRow], block_manager: BlockManager
) -> tuple[HostBatch, dict[int, tuple[list[int], list[int]]]]:
    """The verify forward's inputs: each sequence's chunk, a drafting decode's drafts after its
    newest token, a catching-up sequence's gap before its chunk; the logits rows of every verify
    position, sample row and prompt row. Sets each row's `base` and `logits_rows`; returns the
    prompt rows and their targets by sequence index. A gap's rows write no KV (slot -1): its
    attention reads the KV the plain steps wrote, which stays as it was (a recompute in another
    batch shape differs in the last bits, and a published page is other sequences' context too),
    under DCP as well (each rank derives its slots from the page table but skips the rows marked -1)."""
    items: list[tuple[Sequence, int, list[int]]] = []
    logits_indices: list[int] = []
    prompt: dict[int, tuple[list[int], list[int]]] = {}
    image_rows: list[int] = []
    image_parts: list[torch.Tensor] = []
    gap_rows: list[int] = []  # rows of T whose KV is already in the cache
    T = 0
    for b, r in enumerate(rows):
        seq, n, g = r.sched.seq, r.sched.num_new_tokens, r.gap
        start = seq.num_computed_tokens
        at = start - g  # the position of its first row: the gap's rows give no logits
        tokens = seq.token_ids[at : start + n] + r.drafts
        r.base = T
        if seq.wants_prompt_logprobs:
            first = max(start, len(seq.prompt_logprobs) - 1)
            last = min(start + n, seq.num_prompt_tokens - 1)
            if first < last:
                prompt[b] = (
                    list(range(len(logits_indices), len(logits_indices) + last - first)),
                    seq.token_ids[first + 1 : last + 1],
                )
                logits_indices += range(T + first - at, T + last - at)
        if r.sched.needs_sample:
            r.logits_rows = list(range(len(logits_indices), len(logits_indices) + len(r.drafts) + 1))
            logits_indices += range(T + g + n - 1, T + len(tokens))
        StepPlanner.gather_image_rows(seq, at, g + n, T, image_rows, image_parts)
        items.append((seq, at, tokens))
        gap_rows += range(T, T + g)
        T += len(tokens)
    host = host_batch(block_manager, items, logits_indices)
    host.slots[gap_rows] = -1  # kv_write skips them
    host.image_rows, host.image_parts = image_rows, image_parts
    return host, prompt


def host_batch(
    block_manager: BlockManager,
    items: list[tuple[Sequence, int, list[int]]],
    logits_indices: list[int],
) -> HostBatch:
    """A HostBatch of `(sequence, first position, tokens)` chunks over the sequences' pages."""
    S = block_manager.page_size
    counts = np.array([len(t) for _, _, t in items], dtype=np.int64)  # [B]
    starts = np.array([p for _, p, _ in items], dtype=np.int64)
    B = len(items)
    seq_index = np.repeat(np.arange(B), counts)  # [T]
    query_start = np.zeros(B + 1, dtype=np.int32)
    np.cumsum(counts, out=query_start[1:])
    positions = np.arange(int(counts.sum())) - query_start[seq_index] + starts[seq_index]
    seq_lens = starts + counts
    tables = [seq.page_table for seq, _, _ in items]
    ids, tags = block_manager.page_tables.gather(
        np.array([t.row for t in tables]),
        np.array([t.length for t in tables]),
        -(-seq_lens // S),
    )
    return HostBatch(
        input_ids=np.array([x for _, _, t in items for x in t], dtype=np.int64),
        positions=positions,
        slots=ids[seq_index, positions // S].astype(np.int64) * S + positions % S,
        seq_index=seq_index,
        query_start=query_start,
        seq_lens=seq_lens.astype(np.int32),
        logits_indices=np.array(logits_indices, dtype=np.int64),
        page_table=ids,
        expected_tags=tags,
    )

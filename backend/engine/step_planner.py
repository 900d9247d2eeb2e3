"""A step's inputs on the host: which tokens, positions, KV slots and page-table rows each scheduled
sequence brings, and where its logits rows sit (DESIGN.md §2 step 5 → the model runner).

A pure-decode step (every sequence's one newest token, sampled) is planned without per-token work:
one pass over the sequences for their newest token and position, then numpy over the batch. Other
steps (prefill chunks, prompt log-probs, image rows) walk their tokens. Page tables are never rebuilt:
each sequence's is a row of the block manager's `PageTables`, gathered for the step with one index.

Shape letters: T = new tokens this step, B = sequences, Mp = most pages of one sequence this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from backend.engine.forward_batch import HostBatch
from backend.engine.page_table import PageTables
from backend.engine.scheduler import ScheduledSeq
from backend.engine.sequence import Sequence


@dataclass(slots=True)
class LogitsRows:
    """Where each sequence's logits sit among the batch's logits rows."""

    sampled: list[int]  # the sequences whose chunk samples a token, in batch order
    sample_rows: list[int]  # the logits row of each
    prompt: dict[int, tuple[list[int], list[int]]]  # b -> (rows scoring its prompt tokens, their targets)

    @property
    def is_sample_rows_first(self) -> bool:
        """The sampled rows are rows 0..n-1 (every decode step): their logits are a view."""
        return self.sample_rows == list(range(len(self.sample_rows)))


class StepPlanner:
    def __init__(self, page_size: int, page_tables: PageTables) -> None:
        """`page_tables`: the block manager's pool, whose rows are the sequences' page tables."""
        self.page_size = page_size
        self.page_tables = page_tables

    def plan(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, LogitsRows]:
        """The step's inputs as host arrays, and where each sequence's logits rows will sit."""
        return self._plan_decode(scheduled) or self._plan_mixed(scheduled)

    def _plan_decode(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, LogitsRows] | None:
        """A pure-decode step (every sequence's one newest token, sampled; no prompt log-probs, no
        image row) without per-token work; None for any other step."""
        tokens, positions, rows, lengths = [], [], [], []
        for s in scheduled:
            seq = s.seq
            start = seq.num_computed_tokens
            if (
                s.num_new_tokens != 1
                or len(seq.token_ids) != start + 1
                or (seq.image_embeds is not None and start < seq.num_prompt_tokens)
                or seq.wants_prompt_logprobs
            ):
                return None
            tokens.append(seq.token_ids[start])
            positions.append(start)
            table = seq.page_table
            rows.append(table.row)
            lengths.append(table.length)
        S, B = self.page_size, len(tokens)
        token_ids, pos, table_rows, table_lengths = np.array(
            [tokens, positions, rows, lengths], dtype=np.int64
        )
        cols = pos // S  # the page each new token's KV goes to
        ids, tags = self.page_tables.gather(table_rows, table_lengths, cols + 1)
        ar = np.arange(B)
        host = HostBatch(
            input_ids=token_ids,
            positions=pos,
            slots=ids[ar, cols] * np.int64(S) + pos % S,
            seq_index=ar,
            query_start=np.arange(B + 1, dtype=np.int32),
            seq_lens=(pos + 1).astype(np.int32),
            logits_indices=ar,
            page_table=ids,
            expected_tags=tags,
            is_pure_decode=True,
        )
        everyone = list(range(B))
        return host, LogitsRows(sampled=everyone, sample_rows=everyone, prompt={})

    def _plan_mixed(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, LogitsRows]:
        S = self.page_size
        h = HostBatch()
        input_ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        table_rows: list[int] = []
        lengths: list[int] = []
        logits_indices: list[int] = []
        rows = LogitsRows(sampled=[], sample_rows=[], prompt={})
        for b, s in enumerate(scheduled):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            base = len(input_ids)
            input_ids += seq.token_ids[start : start + n]
            starts.append(start)
            counts.append(n)
            table_rows.append(seq.page_table.row)
            lengths.append(seq.page_table.length)
            if seq.wants_prompt_logprobs:
                first = max(start, len(seq.prompt_logprobs) - 1)  # position scoring the next unscored token
                last = min(start + n, seq.num_prompt_tokens - 1)
                if first < last:
                    rows.prompt[b] = (
                        list(range(len(logits_indices), len(logits_indices) + last - first)),
                        seq.token_ids[first + 1 : last + 1],
                    )
                    logits_indices += range(base + first - start, base + last - start)
            if s.needs_sample:
                rows.sampled.append(b)
                rows.sample_rows.append(len(logits_indices))
                logits_indices.append(base + n - 1)
            self.gather_image_rows(seq, start, n, base, h.image_rows, h.image_parts)
        B = len(scheduled)
        n_arr = np.array(counts, dtype=np.int64)  # [B]
        seq_lens = np.array(starts, dtype=np.int64) + n_arr
        seq_index = np.repeat(np.arange(B), n_arr)  # [T]
        query_start = np.zeros(B + 1, dtype=np.int32)
        np.cumsum(n_arr, out=query_start[1:])
        positions = (
            np.arange(len(input_ids)) - query_start[seq_index] + seq_lens[seq_index] - n_arr[seq_index]
        )
        num_pages = -(-seq_lens // S)
        ids, tags = self.page_tables.gather(np.array(table_rows), np.array(lengths), num_pages)
        h.input_ids = np.array(input_ids, dtype=np.int64)
        h.positions = positions
        h.slots = ids[seq_index, positions // S].astype(np.int64) * S + positions % S
        h.seq_index = seq_index
        h.query_start = query_start
        h.seq_lens = seq_lens.astype(np.int32)
        h.logits_indices = np.array(logits_indices, dtype=np.int64)
        h.page_table, h.expected_tags = ids, tags
        h.is_pure_decode = len(input_ids) == B and not h.image_rows and logits_indices == list(range(B))
        return h, rows

    @staticmethod
    def gather_image_rows(
        seq: Sequence, start: int, n: int, base: int, rows: list[int], parts: list[torch.Tensor]
    ) -> None:
        """Rows of this chunk that are image placeholders, and their vision embeddings."""
        if seq.image_embeds is None:
            return
        offset = 0  # row of seq.image_embeds where the current span begins
        for span in seq.request.image_spans:
            lo, hi = max(span.offset, start), min(span.offset + span.length, start + n)
            if lo < hi:
                rows += [base + p - start for p in range(lo, hi)]
                parts.append(seq.image_embeds[offset + lo - span.offset : offset + hi - span.offset])
            offset += span.length

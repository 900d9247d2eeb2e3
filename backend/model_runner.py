"""Owns the KV cache tensors; turns a scheduled step into a `ForwardBatch`, runs the model, samples.

The only module on the scheduler side that touches tensors. Before each step it copies the block
manager's new page tags into `KVCache.page_tags`, so the tag check inside the attention ops sees
exactly the allocator's state. The ops check tags on both sides: a write whose destination page no
longer carries the expected tag is dropped, a read of such a page contributes nothing, and either
sets `tag_mismatch`; that request's sampled token is then discarded and the engine aborts it.

Pure-decode steps replay a CUDA graph of their batch-size bucket (`backend.decode_graphs`; on a CUDA
device with `EngineConfig.cuda_graphs`); prefill and mixed steps run eagerly. Either way the step's
host inputs (and the page tags allocated since the last step) cross to the device in one copy
(`backend.host_staging`), and the step reads back one small tensor: the sampled tokens and the
tag-mismatch flags together. Page tables are not rebuilt per step: they are rows of the block
manager's `PageTables`, gathered with one index (`backend.page_table`).

Shape letters: T = new tokens this step, B = sequences, Mp = most pages of one sequence, V = vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch

from backend.decode_graphs import Capture, CudaGraphCapture, DecodeGraphs
from backend.engine_config import EngineConfig
from backend.forward_batch import CacheSpec, ForwardBatch, HostBatch, ImageEmbeds, KVCache
from backend.host_staging import StagingBuffer
from backend.page_table import PageTables
from backend.sampler import Sampler, SampleRow, TokenScore
from backend.scheduler import ScheduledSeq, SchedulerOutput
from backend.sequence import Sequence

log = logging.getLogger("kumo.engine")


class PagedModel(Protocol):
    def cache_specs(self) -> list[list[CacheSpec]]: ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor: ...


@dataclass(slots=True)
class SeqResult:
    seq: Sequence
    num_new_tokens: int
    is_tag_mismatch: bool
    sample: TokenScore | None = None
    prompt_scores: list[TokenScore] = field(default_factory=list)  # next-token scores, in order


@dataclass(slots=True)
class _Rows:
    """Where each sequence's logits sit among the batch's logits rows."""

    sample_rows: list[int | None]  # [B] the row sampled for sequence b (None: its chunk samples nothing)
    prompt: dict[int, tuple[list[int], list[int]]]  # b -> (rows scoring its prompt tokens, their targets)


class ModelRunner:
    def __init__(
        self,
        model: PagedModel,
        config: EngineConfig,
        *,
        model_dtype: torch.dtype,
        vocab_size: int,
        device: torch.device | str = "cpu",
        kv_scales: list[dict[str, float]] | None = None,
        max_seq_len: int | None = None,
        graph_capture: Capture | None = None,
        page_tables: PageTables,
    ) -> None:
        """`max_seq_len`: the longest sequence admitted (sizes the decode graphs' page tables; None:
        the whole pool). `graph_capture`: how decode graphs are captured; None: CUDA graphs on a CUDA
        device when `config.cuda_graphs`, else none (`decode_graphs.eager_capture` in CPU tests).
        `page_tables`: the block manager's pool, whose rows are the sequences' page tables."""
        self.model = model
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.page_tables = page_tables
        self.staging = StagingBuffer(self.device)
        self.sampler = Sampler()
        if graph_capture is None and config.cuda_graphs and self.device.type == "cuda":
            graph_capture = CudaGraphCapture(self.device)
        self.kv_cache = KVCache.allocate(
            model.cache_specs(),
            config.num_pages + (graph_capture is not None),  # the decode graphs' scratch page last
            config.page_size,
            dtype=config.torch_kv_dtype(model_dtype),
            model_dtype=model_dtype,
            device=self.device,
            scales=kv_scales,
        )
        self.graphs: DecodeGraphs | None = None
        if graph_capture is not None and config.graph_batch_sizes():
            S = config.page_size
            with torch.inference_mode():
                self.graphs = DecodeGraphs(
                    model.forward,
                    self.kv_cache,
                    batch_sizes=config.graph_batch_sizes(),
                    max_pages=min(-(-(max_seq_len or config.num_pages * S) // S), config.num_pages),
                    check_tags=config.check_page_tags,
                    capture=graph_capture,
                    staging=self.staging,
                )
            if self.graphs.disabled_reason is not None:  # at start-up, once: every step runs eagerly
                log.warning("decode steps run eagerly, not from CUDA graphs: %s", self.graphs.disabled_reason)

    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        """Write (page, new tag) pairs into the cache now, outside a step's own copy (tests)."""
        if updates:
            pages, tags = zip(*updates, strict=True)
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self.kv_cache.page_tags[index] = torch.tensor(tags, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput, tag_updates: list[tuple[int, int]] | None = None) -> list[SeqResult]:
        """Run one step. `tag_updates`: the block manager's (page, new tag) pairs since the last
        step, written into `KVCache.page_tags` before the model reads a page (one copy with the
        step's inputs)."""
        host, rows = self.plan(out.scheduled)
        st, graphs = self.staging, self.graphs
        st.start()
        tags = None
        if tag_updates:
            updates = np.array(tag_updates, dtype=np.int64)  # [U, 2] (page, tag)
            tags = st.add(updates[:, 0]), st.add(updates[:, 1])
        bucket = graphs.stage(host) if graphs is not None and host.is_pure_decode else None
        staged = self._stage_eager(host) if bucket is None else []
        st.send()  # the step's one copy to the device
        if tags is not None:
            self.kv_cache.page_tags.index_copy_(0, st.view(tags[0]), st.view(tags[1]))
        if graphs is not None and bucket is not None:
            logits, mismatch = graphs.replay(host.num_seqs)
        else:
            batch = self._forward_batch(host, staged)
            logits, mismatch = self.model.forward(batch), batch.tag_mismatch  # [N, V], [B]
        # every row that wants a token is sampled, flagged or not (a flagged one's token is dropped),
        # so the tokens and the flags come back in one copy
        to_sample = [(b, i) for b, i in enumerate(rows.sample_rows) if i is not None]
        sample_rows = [self._sample_row(out.scheduled[b].seq) for b, _ in to_sample]
        picked = self._logits_rows(logits, [i for _, i in to_sample])
        chosen = (
            self.sampler.draw(picked, sample_rows) if to_sample else mismatch.new_zeros(0, dtype=torch.int64)
        )
        back = torch.cat([chosen, mismatch.to(torch.int64)]).tolist()  # the step's one copy back
        tokens, flags = back[: len(to_sample)], back[len(to_sample) :]
        results = [SeqResult(s.seq, s.num_new_tokens, bool(flags[b])) for b, s in enumerate(out.scheduled)]
        if to_sample:
            scores = self.sampler.scores(picked, sample_rows, chosen, tokens)
            for (b, _), score in zip(to_sample, scores, strict=True):
                if not results[b].is_tag_mismatch:
                    results[b].sample = score
        for b, (prompt_rows, targets) in rows.prompt.items():
            r = results[b]
            if not r.is_tag_mismatch:
                index = torch.tensor(prompt_rows, dtype=torch.int64, device=logits.device)
                r.prompt_scores = self.sampler.score(
                    logits[index], targets, r.seq.request.sampling.top_logprobs
                )
        return results

    @staticmethod
    def _logits_rows(logits: torch.Tensor, index: list[int]) -> torch.Tensor:
        """`logits[index]`: a view when the rows are 0..n-1 (every decode step), else a gather."""
        if index == list(range(len(index))):
            return logits[: len(index)]
        return logits[torch.tensor(index, dtype=torch.int64, device=logits.device)]

    def synchronize(self) -> None:
        """Wait until nothing launched on the device can still write into the cache."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def find_mismatch(self, seq: Sequence) -> tuple[int, int, int] | None:
        """(page, expected tag, found tag) of the first page of `seq` that changed owner (for logs)."""
        found = self.kv_cache.page_tags.tolist()
        for ref in seq.page_table:
            if not 0 <= ref.page_id < len(found) or found[ref.page_id] != ref.tag:
                got = found[ref.page_id] if 0 <= ref.page_id < len(found) else -1
                return ref.page_id, ref.tag, got
        return None

    # ---- batch construction --------------------------------------------------------------------
    def plan(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, _Rows]:
        """The step's inputs as host arrays, and where each sequence's logits rows will sit."""
        return self._plan_decode(scheduled) or self._plan_mixed(scheduled)

    def _plan_decode(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, _Rows] | None:
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
        S, B = self.config.page_size, len(tokens)
        pos = np.array(positions, dtype=np.int64)  # [B]
        num_pages = pos // S + 1
        ids, tags = self.page_tables.gather(np.array(rows), np.array(lengths), num_pages)
        ar = np.arange(B)
        host = HostBatch(
            input_ids=np.array(tokens, dtype=np.int64),
            positions=pos,
            slots=ids[ar, pos // S].astype(np.int64) * S + pos % S,
            seq_index=ar,
            query_start=np.arange(B + 1, dtype=np.int32),
            seq_lens=(pos + 1).astype(np.int32),
            logits_indices=ar,
            page_table=ids,
            expected_tags=tags,
        )
        return host, _Rows(sample_rows=list(range(B)), prompt={})

    def _plan_mixed(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, _Rows]:
        S = self.config.page_size
        h = HostBatch()
        input_ids: list[int] = []
        starts: list[int] = []
        counts: list[int] = []
        table_rows: list[int] = []
        lengths: list[int] = []
        logits_indices: list[int] = []
        rows = _Rows(sample_rows=[], prompt={})
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
            rows.sample_rows.append(len(logits_indices) if s.needs_sample else None)
            if s.needs_sample:
                logits_indices.append(base + n - 1)
            self._gather_image_rows(seq, start, n, base, h.image_rows, h.image_parts)
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
        return h, rows

    def _stage_eager(self, h: HostBatch) -> list[int]:
        """Stage the eager step's ForwardBatch fields (page tables as wide as its widest sequence)."""
        fields = (h.input_ids, h.positions, h.query_start, h.seq_lens, h.page_table, h.expected_tags)
        return [self.staging.add(a) for a in (*fields, h.slots, h.logits_indices, h.seq_index)]

    def _forward_batch(self, h: HostBatch, staged: list[int]) -> ForwardBatch:
        """The eager step's ForwardBatch: views of the staged copy (`_stage_eager`)."""
        v = [self.staging.view(i) for i in staged]
        dev = self.device
        image_embeds = None
        if h.image_rows:
            image_embeds = ImageEmbeds(
                token_indices=torch.tensor(h.image_rows, dtype=torch.int64, device=dev),
                embeds=torch.cat(h.image_parts).to(dev),
            )
        B = h.num_seqs
        return ForwardBatch(
            input_ids=v[0],
            positions=v[1],
            query_start=v[2],
            seq_lens=v[3],
            page_table=v[4],
            expected_tags=v[5],
            slot_mapping=v[6],
            logits_indices=v[7],
            kv_cache=self.kv_cache,
            tag_mismatch=torch.zeros(B, dtype=torch.bool, device=dev),
            is_decode_only=len(h.input_ids) == B,
            check_tags=self.config.check_page_tags,
            image_embeds=image_embeds,
            seq_index=v[8],
        )

    @staticmethod
    def _gather_image_rows(
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

    def _sample_row(self, seq: Sequence) -> SampleRow:
        row = seq.sample_row
        if seq.constraint is not None:  # this step's mask
            row.allowed = seq.constraint.allowed_tokens(self.vocab_size)
        return row

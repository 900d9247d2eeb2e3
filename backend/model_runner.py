"""Owns the KV cache tensors; turns a scheduled step into a `ForwardBatch`, runs the model, samples.

The only module on the scheduler side that touches tensors. Before each step it copies the block
manager's new page tags into `KVCache.page_tags`, so the tag check inside the attention ops sees
exactly the allocator's state. The ops check tags on both sides: a write whose destination page no
longer carries the expected tag is dropped, a read of such a page contributes nothing, and either
sets `tag_mismatch`; that request's sampled token is then discarded and the engine aborts it.

Pure-decode steps replay a CUDA graph of their batch-size bucket (`backend.decode_graphs`; on a CUDA
device with `EngineConfig.cuda_graphs`); prefill and mixed steps run eagerly. Either way the step
reads back one small tensor: the sampled tokens and the tag-mismatch flags together.

Shape letters: T = new tokens this step, B = sequences, Mp = most pages of one sequence, V = vocab.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Protocol

import torch

from backend.decode_graphs import Capture, CudaGraphCapture, DecodeGraphs
from backend.engine_config import EngineConfig
from backend.forward_batch import CacheSpec, ForwardBatch, HostBatch, ImageEmbeds, KVCache
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
    """Where one sequence's logits sit among the batch's logits rows."""

    prompt_rows: list[int] = field(default_factory=list)
    prompt_targets: list[int] = field(default_factory=list)
    sample_row: int | None = None


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
    ) -> None:
        """`max_seq_len`: the longest sequence admitted (sizes the decode graphs' page tables; None:
        the whole pool). `graph_capture`: how decode graphs are captured; None: CUDA graphs on a CUDA
        device when `config.cuda_graphs`, else none (`decode_graphs.eager_capture` in CPU tests)."""
        self.model = model
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
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
                )
            if self.graphs.disabled_reason is not None:  # at start-up, once: every step runs eagerly
                log.warning("decode steps run eagerly, not from CUDA graphs: %s", self.graphs.disabled_reason)

    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        if updates:
            pages, tags = zip(*updates, strict=True)
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self.kv_cache.page_tags[index] = torch.tensor(tags, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[SeqResult]:
        host, rows = self.plan(out.scheduled)
        ran = self.graphs.run(host) if self.graphs is not None and host.is_pure_decode else None
        if ran is None:
            batch = self.to_device(host)
            logits, mismatch = self.model.forward(batch), batch.tag_mismatch  # [N, V], [B]
        else:
            logits, mismatch = ran
        # every row that wants a token is sampled, flagged or not (a flagged one's token is dropped),
        # so the tokens and the flags come back in one copy
        to_sample = [(b, r.sample_row) for b, r in enumerate(rows) if r.sample_row is not None]
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
        for b, r in enumerate(results):
            if rows[b].prompt_rows and not r.is_tag_mismatch:
                index = torch.tensor(rows[b].prompt_rows, dtype=torch.int64, device=logits.device)
                r.prompt_scores = self.sampler.score(
                    logits[index], rows[b].prompt_targets, r.seq.request.sampling.top_logprobs
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
    def plan(self, scheduled: list[ScheduledSeq]) -> tuple[HostBatch, list[_Rows]]:
        """The step's inputs as host lists, and where each sequence's logits rows will sit."""
        S = self.config.page_size
        h = HostBatch()
        rows: list[_Rows] = []
        for b, s in enumerate(scheduled):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            base = len(h.input_ids)
            h.input_ids += seq.token_ids[start : start + n]
            h.positions += range(start, start + n)
            for i in range(start // S, (start + n - 1) // S + 1):  # page by page, not token by token
                lo, hi = max(start, i * S), min(start + n, (i + 1) * S)
                base_slot = seq.page_table[i].page_id * S - i * S
                h.slots += range(base_slot + lo, base_slot + hi)
            h.seq_index += [b] * n
            h.query_start.append(len(h.input_ids))
            h.seq_lens.append(start + n)
            refs = seq.page_table[: -(-(start + n) // S)]
            h.page_ids.append([ref.page_id for ref in refs])
            h.expected_tags.append([ref.tag for ref in refs])
            r = _Rows()
            if seq.wants_prompt_logprobs:
                first = max(start, len(seq.prompt_logprobs) - 1)  # position scoring the next unscored token
                for pos in range(first, min(start + n, seq.num_prompt_tokens - 1)):
                    r.prompt_rows.append(len(h.logits_indices))
                    r.prompt_targets.append(seq.token_ids[pos + 1])
                    h.logits_indices.append(base + pos - start)
            if s.needs_sample:
                r.sample_row = len(h.logits_indices)
                h.logits_indices.append(base + n - 1)
            rows.append(r)
            self._gather_image_rows(seq, start, n, base, h.image_rows, h.image_parts)
        return h, rows

    def to_device(self, h: HostBatch) -> ForwardBatch:
        """The eager step's ForwardBatch: page tables as wide as the step's widest sequence."""
        B = len(h.seq_lens)
        width = max(len(p) for p in h.page_ids)
        page_table = torch.zeros(B, width, dtype=torch.int32)
        expected = torch.full((B, width), -1, dtype=torch.int64)
        for b in range(B):
            page_table[b, : len(h.page_ids[b])] = torch.tensor(h.page_ids[b], dtype=torch.int32)
            expected[b, : len(h.expected_tags[b])] = torch.tensor(h.expected_tags[b], dtype=torch.int64)
        dev = self.device
        image_embeds = None
        if h.image_rows:
            image_embeds = ImageEmbeds(
                token_indices=torch.tensor(h.image_rows, dtype=torch.int64, device=dev),
                embeds=torch.cat(h.image_parts).to(dev),
            )
        return ForwardBatch(
            input_ids=torch.tensor(h.input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(h.positions, dtype=torch.int64, device=dev),
            query_start=torch.tensor(h.query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(h.seq_lens, dtype=torch.int32, device=dev),
            page_table=page_table.to(dev),
            expected_tags=expected.to(dev),
            slot_mapping=torch.tensor(h.slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(h.logits_indices, dtype=torch.int64, device=dev),
            kv_cache=self.kv_cache,
            tag_mismatch=torch.zeros(B, dtype=torch.bool, device=dev),
            is_decode_only=len(h.input_ids) == B,
            check_tags=self.config.check_page_tags,
            image_embeds=image_embeds,
            seq_index=torch.tensor(h.seq_index, dtype=torch.int64, device=dev),
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
        allowed = seq.constraint.allowed_tokens(self.vocab_size) if seq.constraint is not None else None
        return SampleRow(
            params=seq.request.sampling,
            generator=seq.generator,
            prompt_ids=seq.token_ids[: seq.num_prompt_tokens],
            output_ids=seq.output_token_ids,
            allowed=allowed,
        )

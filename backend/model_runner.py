"""Owns the KV cache tensors; turns a scheduled step into a `ForwardBatch`, runs the model, samples.

The only module on the scheduler side that touches tensors. Before each step it copies the block
manager's new page tags into `KVCache.page_tags`, so the tag check inside the attention ops sees
exactly the allocator's state. The ops check tags on both sides: a write whose destination page no
longer carries the expected tag is dropped, a read of such a page contributes nothing, and either
sets `tag_mismatch`; that request's sampled token is then discarded and the engine aborts it.

Shape letters: T = new tokens this step, B = sequences, Mp = most pages of one sequence, V = vocab.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from backend.engine_config import EngineConfig
from backend.forward_batch import CacheSpec, ForwardBatch, ImageEmbeds, KVCache
from backend.sampler import Sampler, SampleRow, TokenScore
from backend.scheduler import ScheduledSeq, SchedulerOutput
from backend.sequence import Sequence


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
    ) -> None:
        self.model = model
        self.config = config
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.sampler = Sampler()
        self.kv_cache = KVCache.allocate(
            model.cache_specs(),
            config.num_pages,
            config.page_size,
            dtype=config.torch_kv_dtype(model_dtype),
            model_dtype=model_dtype,
            device=self.device,
            scales=kv_scales,
        )

    def apply_tag_updates(self, updates: list[tuple[int, int]]) -> None:
        if updates:
            pages, tags = zip(*updates, strict=True)
            index = torch.tensor(pages, dtype=torch.int64, device=self.device)
            self.kv_cache.page_tags[index] = torch.tensor(tags, dtype=torch.int64, device=self.device)

    @torch.inference_mode()
    def run(self, out: SchedulerOutput) -> list[SeqResult]:
        batch, rows = self.build_batch(out.scheduled)
        logits = self.model.forward(batch)  # [N, V]
        mismatch = batch.tag_mismatch.tolist()
        results = [SeqResult(s.seq, s.num_new_tokens, bool(mismatch[b])) for b, s in enumerate(out.scheduled)]
        to_sample = [(r, rows[b].sample_row) for b, r in enumerate(results) if not r.is_tag_mismatch]
        to_sample = [(r, i) for r, i in to_sample if i is not None]
        if to_sample:
            sample_rows = [self._sample_row(r.seq) for r, _ in to_sample]
            index = torch.tensor([i for _, i in to_sample], dtype=torch.int64, device=logits.device)
            scores = self.sampler.sample(logits[index], sample_rows)
            for (r, _), score in zip(to_sample, scores, strict=True):
                r.sample = score
        for b, r in enumerate(results):
            if rows[b].prompt_rows and not r.is_tag_mismatch:
                index = torch.tensor(rows[b].prompt_rows, dtype=torch.int64, device=logits.device)
                r.prompt_scores = self.sampler.score(
                    logits[index], rows[b].prompt_targets, r.seq.request.sampling.top_logprobs
                )
        return results

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
    def build_batch(self, scheduled: list[ScheduledSeq]) -> tuple[ForwardBatch, list[_Rows]]:
        S = self.config.page_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_index: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        rows: list[_Rows] = []
        image_rows: list[int] = []
        image_parts: list[torch.Tensor] = []
        for b, s in enumerate(scheduled):
            seq, start, n = s.seq, s.seq.num_computed_tokens, s.num_new_tokens
            base = len(input_ids)
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            for i in range(start // S, (start + n - 1) // S + 1):  # page by page, not token by token
                lo, hi = max(start, i * S), min(start + n, (i + 1) * S)
                base_slot = seq.page_table[i].page_id * S - i * S
                slots += range(base_slot + lo, base_slot + hi)
            seq_index += [b] * n
            query_start.append(len(input_ids))
            seq_lens.append(start + n)
            r = _Rows()
            if seq.wants_prompt_logprobs:
                first = max(start, len(seq.prompt_logprobs) - 1)  # position scoring the next unscored token
                for pos in range(first, min(start + n, seq.num_prompt_tokens - 1)):
                    r.prompt_rows.append(len(logits_indices))
                    r.prompt_targets.append(seq.token_ids[pos + 1])
                    logits_indices.append(base + pos - start)
            if s.needs_sample:
                r.sample_row = len(logits_indices)
                logits_indices.append(base + n - 1)
            rows.append(r)
            self._gather_image_rows(seq, start, n, base, image_rows, image_parts)
        max_pages = max(-(-n // S) for n in seq_lens)
        page_table = torch.zeros(len(scheduled), max_pages, dtype=torch.int32)
        expected = torch.full((len(scheduled), max_pages), -1, dtype=torch.int64)
        for b, s in enumerate(scheduled):
            refs = s.seq.page_table[: -(-seq_lens[b] // S)]
            page_table[b, : len(refs)] = torch.tensor([ref.page_id for ref in refs], dtype=torch.int32)
            expected[b, : len(refs)] = torch.tensor([ref.tag for ref in refs], dtype=torch.int64)
        dev = self.device
        image_embeds = None
        if image_rows:
            image_embeds = ImageEmbeds(
                token_indices=torch.tensor(image_rows, dtype=torch.int64, device=dev),
                embeds=torch.cat(image_parts).to(dev),
            )
        batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(positions, dtype=torch.int64, device=dev),
            query_start=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=page_table.to(dev),
            expected_tags=expected.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.tensor(logits_indices, dtype=torch.int64, device=dev),
            kv_cache=self.kv_cache,
            tag_mismatch=torch.zeros(len(scheduled), dtype=torch.bool, device=dev),
            is_decode_only=all(s.num_new_tokens == 1 for s in scheduled),
            check_tags=self.config.check_page_tags,
            image_embeds=image_embeds,
            seq_index=torch.tensor(seq_index, dtype=torch.int64, device=dev),
        )
        return batch, rows

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

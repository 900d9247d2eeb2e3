"""A small stand-in for the engine in model tests: contiguous pages, chunked prefill, then decode.

It builds `ForwardBatch`es exactly as the seam describes (page table with expected tags, slot
mapping, per-sequence query ranges) so the models are tested through the paged cache, not around it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from backend.engine.forward_batch import ForwardBatch, KVCache


@dataclass
class Seq:
    tokens: list[int]
    num_cached: int = 0
    pages: list[int] = field(default_factory=list)
    tags: list[int] = field(default_factory=list)  # the tag each page carried when it was allocated


class PagedDriver:
    def __init__(
        self,
        model: torch.nn.Module,
        *,
        page_size: int = 16,
        num_pages: int = 64,
        kv_dtype: torch.dtype | None = None,
        scales: list[dict[str, float]] | None = None,
        device: torch.device | str = "cpu",
        dcp: int = 1,
    ) -> None:
        """`dcp` > 1: the model shards its MLA cache by token over dcp ranks (backend/models/layers/
        context_parallel.py), so a page holds page_size·dcp tokens of a sequence, page_size here."""
        self.model, self.device, self.dcp = model, torch.device(device), dcp
        dtype = model.dtype  # type: ignore[attr-defined]
        specs = model.cache_specs()  # type: ignore[operator]
        self.kv = KVCache.allocate(
            specs, num_pages, page_size, kv_dtype or dtype, dtype, device=device, scales=scales
        )
        self.kv.page_tags.copy_(torch.arange(num_pages) * 7 + 3)  # arbitrary distinct tags
        self.free = list(range(num_pages))
        self.last_mismatch = torch.zeros(0, dtype=torch.bool)

    def batch(self, seqs: list[Seq], num_new: list[int]) -> ForwardBatch:
        S = self.kv.page_size
        ids, pos, slots, starts = [], [], [], [0]
        for s, n in zip(seqs, num_new, strict=True):
            end = s.num_cached + n
            while len(s.pages) * S * self.dcp < end:
                s.pages.append(self.free.pop(0))
                s.tags.append(int(self.kv.page_tags[s.pages[-1]]))
            for i in range(s.num_cached, end):
                ids.append(s.tokens[i])
                pos.append(i)
                # under DCP each rank finds its own slots from the page table: 0 is ignored (-1 skips)
                slots.append(s.pages[i // S] * S + i % S if self.dcp == 1 else 0)
            starts.append(starts[-1] + n)
        Mp = max(len(s.pages) for s in seqs)
        table = torch.zeros(len(seqs), Mp, dtype=torch.int32)
        tags = torch.full((len(seqs), Mp), -1, dtype=torch.int64)
        for b, s in enumerate(seqs):
            table[b, : len(s.pages)] = torch.tensor(s.pages, dtype=torch.int32)
            tags[b, : len(s.pages)] = torch.tensor(s.tags, dtype=torch.int64)
        T, dev = len(ids), self.device
        seq_lens = [s.num_cached + n for s, n in zip(seqs, num_new, strict=True)]
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=dev),
            positions=torch.tensor(pos, dtype=torch.int64, device=dev),
            query_start=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            page_table=table.to(dev),
            expected_tags=tags.to(dev),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            logits_indices=torch.arange(T, dtype=torch.int64, device=dev),
            kv_cache=self.kv,
            tag_mismatch=torch.zeros(len(seqs), dtype=torch.bool, device=dev),
            is_decode_only=all(n == 1 for n in num_new),
        )

    def run(self, seqs: list[Seq], num_new: list[int]) -> list[torch.Tensor]:
        """One step; returns each sequence's logits for its new tokens ([n, vocab] each)."""
        batch = self.batch(seqs, num_new)
        logits = self.model(batch)
        self.last_mismatch = batch.tag_mismatch.clone()
        out = []
        for b, (s, n) in enumerate(zip(seqs, num_new, strict=True)):
            out.append(logits[int(batch.query_start[b]) : int(batch.query_start[b + 1])])
            s.num_cached += n
        return out

    def prefill(self, prompts: list[list[int]], chunk: int) -> tuple[list[Seq], list[torch.Tensor]]:
        """Chunked prefill of all prompts together; returns the sequences and all-position logits."""
        seqs = [Seq(tokens=list(p)) for p in prompts]
        pieces: list[list[torch.Tensor]] = [[] for _ in prompts]
        while any(s.num_cached < len(s.tokens) for s in seqs):
            live = [b for b, s in enumerate(seqs) if s.num_cached < len(s.tokens)]
            num_new = [min(chunk, len(seqs[b].tokens) - seqs[b].num_cached) for b in live]
            for b, lg in zip(live, self.run([seqs[b] for b in live], num_new), strict=True):
                pieces[b].append(lg)
        return seqs, [torch.cat(p) for p in pieces]

    def greedy(self, prompts: list[list[int]], num_steps: int, chunk: int) -> list[list[int]]:
        """Chunked prefill, then `num_steps` batched greedy decode steps; returns generated tokens."""
        seqs, logits = self.prefill(prompts, chunk)
        out = [[int(lg[-1].argmax())] for lg in logits]
        for s, o in zip(seqs, out, strict=True):
            s.tokens.append(o[0])
        for _ in range(num_steps - 1):
            step_logits = self.run(seqs, [1] * len(seqs))
            for s, o, lg in zip(seqs, out, step_logits, strict=True):
                o.append(int(lg[-1].argmax()))
                s.tokens.append(o[-1])
        return out

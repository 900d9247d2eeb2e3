"""Running whole prompts through a paged model outside the engine, for calibration and evaluation.

One sequence at a time over its own small page pool: the prompt is fed in chunks of `chunk`
tokens, so every chunk after the first attends to KV read back from the cache (FP8 when asked),
exactly as a chunked prefill or a decode step would in the engine; `greedy` then decodes one token
per step from that cache.
Shape letters: T prompt tokens, S page size, V vocab.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from backend.forward_batch import ForwardBatch, KVCache


class PromptRunner:
    def __init__(
        self,
        model: nn.Module,
        *,
        model_dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
        scales: list[dict[str, float]] | None = None,
        page_size: int = 16,
        chunk: int = 8,
    ) -> None:
        self.model, self.model_dtype = model, model_dtype
        self.kv_dtype = kv_dtype or model_dtype
        self.scales, self.page_size, self.chunk = scales, page_size, chunk
        self.kv: KVCache | None = None
        self.device = next(model.parameters()).device

    def _cache(self, num_tokens: int) -> KVCache:
        pages = math.ceil(num_tokens / self.page_size)
        specs = self.model.cache_specs()  # type: ignore[operator]
        return KVCache.allocate(
            specs,
            pages,
            self.page_size,
            self.kv_dtype,
            self.model_dtype,
            device=self.device,
            scales=self.scales,
        )

    def _step(self, ids: list[int], start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of `ids`, whose prefix is already cached -> logits [end - start, V]."""
        kv, S, n = self.kv, self.page_size, end - start
        assert kv is not None
        num_pages = math.ceil(end / S)
        dev = self.device
        batch = ForwardBatch(
            input_ids=torch.tensor(ids[start:end], dtype=torch.int64, device=dev),
            positions=torch.arange(start, end, dtype=torch.int64, device=dev),
            query_start=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
            page_table=torch.arange(num_pages, dtype=torch.int32, device=dev)[None],
            expected_tags=kv.page_tags[None, :num_pages].clone(),
            slot_mapping=torch.arange(
                start, end, dtype=torch.int64, device=dev
            ),  # pages in order: slot = position
            logits_indices=torch.arange(n, dtype=torch.int64, device=dev),
            kv_cache=kv,
            tag_mismatch=torch.zeros(1, dtype=torch.bool, device=dev),
            is_decode_only=n == 1,
            seq_index=torch.zeros(n, dtype=torch.int64, device=dev),
        )
        logits = self.model(batch).cpu()
        if bool(batch.tag_mismatch.any()):
            raise RuntimeError("page tag mismatch in a private page pool: the model misread its cache")
        return logits

    @torch.no_grad()
    def logits(self, ids: list[int], *, reserve: int = 0) -> torch.Tensor:
        """float32 logits [T, V] at every position of `ids`; `self.kv` keeps the filled cache, with
        room for `reserve` more tokens."""
        self.kv = self._cache(len(ids) + reserve)
        return torch.cat(
            [self._step(ids, s, min(len(ids), s + self.chunk)) for s in range(0, len(ids), self.chunk)]
        )

    @torch.no_grad()
    def greedy(
        self, ids: list[int], max_new_tokens: int, stop_ids: frozenset[int] = frozenset()
    ) -> list[int]:
        """Argmax decoding after a chunked prefill; stops at a stop id (not returned) or the limit."""
        seq = list(ids)
        last = self.logits(seq, reserve=max_new_tokens)[-1]
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(last.argmax())
            if token in stop_ids:
                break
            out.append(token)
            seq.append(token)
            last = self._step(seq, len(seq) - 1, len(seq))[-1]
        return out

    def cache_amax(self, num_tokens: int) -> list[dict[str, float]]:
        """Per layer, per cached tensor: max |value| over the first `num_tokens` slots just written."""
        assert self.kv is not None
        return [
            {name: float(t.flatten(0, 1)[:num_tokens].float().abs().amax()) for name, t in layer.items()}
            for layer in self.kv.layers
        ]

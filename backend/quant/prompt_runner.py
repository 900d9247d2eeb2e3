"""Running whole prompts through a paged model outside the engine, for calibration and evaluation.

One sequence at a time over its own small page pool: the prompt is fed in chunks of `chunk`
tokens, so every chunk after the first attends to KV read back from the cache (FP8 when asked),
exactly as a chunked prefill or a decode step would in the engine.
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

    def _cache(self, num_tokens: int) -> KVCache:
        pages = math.ceil(num_tokens / self.page_size)
        specs = self.model.cache_specs()  # type: ignore[operator]
        return KVCache.allocate(specs, pages, self.page_size, self.kv_dtype, self.model_dtype, scales=self.scales)

    @torch.no_grad()
    def logits(self, ids: list[int]) -> torch.Tensor:
        """float32 logits [T, V] at every position of `ids`; `self.kv` keeps the filled cache."""
        T, S = len(ids), self.page_size
        kv = self.kv = self._cache(T)
        pages = torch.arange(kv.num_pages, dtype=torch.int32)
        out = []
        for start in range(0, T, self.chunk):
            end = min(T, start + self.chunk)
            n = end - start
            batch = ForwardBatch(
                input_ids=torch.tensor(ids[start:end], dtype=torch.int64),
                positions=torch.arange(start, end, dtype=torch.int64),
                query_start=torch.tensor([0, n], dtype=torch.int32),
                seq_lens=torch.tensor([end], dtype=torch.int32),
                page_table=pages[None, : math.ceil(end / S)],
                expected_tags=kv.page_tags[None, : math.ceil(end / S)].clone(),
                slot_mapping=torch.arange(start, end, dtype=torch.int64),  # pages in order: slot = position
                logits_indices=torch.arange(n, dtype=torch.int64),
                kv_cache=kv,
                tag_mismatch=torch.zeros(1, dtype=torch.bool),
                is_decode_only=n == 1,
                seq_index=torch.zeros(n, dtype=torch.int64),
            )
            out.append(self.model(batch))
            if bool(batch.tag_mismatch.any()):
                raise RuntimeError("page tag mismatch in a private page pool: the model misread its cache")
        return torch.cat(out)

    def cache_amax(self, num_tokens: int) -> list[dict[str, float]]:
        """Per layer, per cached tensor: max |value| over the first `num_tokens` slots just written."""
        assert self.kv is not None
        return [
            {name: float(t.flatten(0, 1)[:num_tokens].float().abs().amax()) for name, t in layer.items()}
            for layer in self.kv.layers
        ]

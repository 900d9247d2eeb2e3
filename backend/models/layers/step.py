"""Per-step facts every layer needs, derived once from the ForwardBatch.

Shapes: T new tokens, B sequences, S page size, Dr rotary dims / 2 per cos/sin row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from backend.engine.forward_batch import ForwardBatch
from kernels.kv_write import kv_write_ref


@dataclass(slots=True)
class Step:
    batch: ForwardBatch
    token_seq: torch.Tensor  # [T] int64 sequence of each new token
    token_expected_tags: torch.Tensor | None  # [T] int64 tag each destination page must carry; None: off
    cos: torch.Tensor  # [T, Dr]
    sin: torch.Tensor  # [T, Dr]
    topk_indices: torch.Tensor | None = None  # DSA: the last full indexer layer's choice, [T, K]

    @classmethod
    def build(cls, batch: ForwardBatch, cos: torch.Tensor, sin: torch.Tensor) -> Step:
        qs = batch.query_start.long()
        q_lens = qs[1:] - qs[:-1]  # [B]
        T = batch.num_tokens
        if batch.seq_index.numel() == T:
            token_seq = batch.seq_index.long()
        else:
            token_seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=qs.device), q_lens)
        expected = None  # the tag check off: no tag is read
        if batch.check_tags:
            # index of each new token within its sequence: the cached prefix length plus its offset
            offset = torch.arange(T, device=qs.device) - qs[token_seq]
            token_idx = (batch.seq_lens.long() - q_lens)[token_seq] + offset
            page_col = token_idx // batch.kv_cache.page_size
            expected = batch.expected_tags[token_seq, page_col.clamp(max=batch.expected_tags.shape[1] - 1)]
        return cls(batch=batch, token_seq=token_seq, token_expected_tags=expected, cos=cos, sin=sin)

    def write(self, layer_idx: int, name: str, values: torch.Tensor) -> None:
        """Store this step's new `values [T, *shape]` for `layer_idx`/`name` into the paged cache."""
        kv = self.batch.kv_cache
        write = kv_write_ref
        if values.is_cuda:  # the Triton op: no host sync, so a step can be captured in a CUDA graph
            from kernels.kv_write_triton import kv_write  # triton is the gpu extra: imported only here

            write = kv_write
        write(
            kv.layers[layer_idx][name],
            values,
            self.batch.slot_mapping,
            kv.scales[layer_idx][name],
            kv.page_tags,
            self.token_expected_tags,
            self.token_seq,
            self.batch.tag_mismatch,
        )

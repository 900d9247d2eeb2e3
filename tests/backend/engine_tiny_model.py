"""A tiny causal attention LM over the paged KV cache, written with the models' contract.

It checks tags the way the real ops do: a new token's K and V are written through `slot_mapping` only
if the destination page carries the tag its sequence expects, and every read (prefill and decode
alike) goes through `kernels.paged_gather.check_page_tags_ref`, a mismatching page contributing nothing;
both set `tag_mismatch`; with `batch.check_tags` off it reads no tag. Used to test the engine
until, and beside, the real tiny checkpoints. Shape letters: T tokens, H hidden, S page size.
"""

from __future__ import annotations

import torch

from backend.engine.forward_batch import CacheSpec, ForwardBatch
from kernels.paged_gather import check_page_tags_ref, mismatch_from_ok


class TinyPagedModel(torch.nn.Module):
    def __init__(self, vocab_size: int = 97, hidden: int = 32, num_layers: int = 2, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab_size, self.hidden, self.num_layers = vocab_size, hidden, num_layers
        scale = hidden**-0.5

        def w(*shape: int, s: float = scale) -> torch.nn.Parameter:
            return torch.nn.Parameter(torch.randn(*shape, generator=g) * s, requires_grad=False)

        self.embed = w(vocab_size, hidden, s=1.0)
        self.pos = w(4096, hidden, s=0.5)
        self.wq = w(num_layers, hidden, hidden)
        self.wk = w(num_layers, hidden, hidden)
        self.wv = w(num_layers, hidden, hidden)
        self.wo = w(num_layers, hidden, hidden)
        self.head = w(hidden, vocab_size, s=3.0 * scale)
        self.num_forward_calls = 0

    def cache_specs(self) -> list[list[CacheSpec]]:
        return [
            [CacheSpec("k", (1, self.hidden)), CacheSpec("v", (1, self.hidden))]
            for _ in range(self.num_layers)
        ]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        self.num_forward_calls += 1
        cache = batch.kv_cache
        S = cache.page_size
        x = self.embed[batch.input_ids] + self.pos[batch.positions]  # [T, H]
        if batch.image_embeds is not None:
            x[batch.image_embeds.token_indices] = batch.image_embeds.embeds.to(x.dtype)
        num_pages = (batch.seq_lens.long() + S - 1) // S  # [B]
        for layer in range(self.num_layers):
            q, k, v = x @ self.wq[layer], x @ self.wk[layer], x @ self.wv[layer]  # [T, H]
            self._write(batch, cache.layers[layer], k, v)
            if batch.check_tags:
                ok = check_page_tags_ref(cache.page_tags, batch.page_table, batch.expected_tags, num_pages)
                batch.tag_mismatch |= mismatch_from_ok(ok, num_pages)  # ok: [B, Mp]
            else:  # every page in use counts, unread
                ok = torch.arange(batch.page_table.shape[1], device=x.device)[None, :] < num_pages[:, None]
            out = torch.empty_like(x)
            for b in range(batch.num_seqs):
                lo, hi = int(batch.query_start[b]), int(batch.query_start[b + 1])
                n_pages, seq_len = int(num_pages[b]), int(batch.seq_lens[b])
                pages = batch.page_table[b, :n_pages].long()
                keys = cache.layers[layer]["k"][pages].reshape(n_pages * S, -1)[:seq_len].float()  # [L, H]
                vals = cache.layers[layer]["v"][pages].reshape(n_pages * S, -1)[:seq_len].float()
                page_ok = ok[b, :n_pages].repeat_interleave(S)[:seq_len]  # [L]
                key_pos = torch.arange(seq_len, device=x.device)
                visible = (key_pos[None, :] <= batch.positions[lo:hi, None]) & page_ok[None, :]  # [t, L]
                scores = (q[lo:hi] @ keys.T) * self.hidden**-0.5
                attn = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1).nan_to_num(0.0)
                out[lo:hi] = attn @ vals
            x = x + torch.tanh(out @ self.wo[layer])
        return (x[batch.logits_indices] @ self.head).float()  # [N, V]

    @staticmethod
    def _write(
        batch: ForwardBatch, layer_cache: dict[str, torch.Tensor], k: torch.Tensor, v: torch.Tensor
    ) -> None:
        S = batch.kv_cache.page_size
        slots = batch.slot_mapping
        pages = slots.clamp(min=0) // S  # [T]
        keep = slots >= 0
        if batch.check_tags:
            expected = batch.expected_tags[batch.seq_index, batch.positions // S]  # [T]
            owned = batch.kv_cache.page_tags[pages] == expected
            batch.tag_mismatch[batch.seq_index[keep & ~owned].unique()] = True
            keep &= owned
        for name, value in (("k", k), ("v", v)):
            flat = layer_cache[name].view(-1, value.shape[-1])  # [P*S, H]
            flat[slots[keep]] = value[keep].to(flat.dtype)

"""Multi-head latent attention over the paged latent cache, with absorbed weights (reference op).

The cache holds one `[kv_lora_rank + rope_dim]` line per token (576 for DeepSeek-V3 / Kimi K2):
the normalised latent `c` then the rotated `k_pe`. Queries come already absorbed:
`q = [q_nope · W_UK | q_pe]` per head, so attention is MQA with one shared "head": the key is the
whole cache line and the value is its first `kv_lora_rank` dims. The caller multiplies the latent
output by W_UV. With `topk_indices` (DeepSeek Sparse Attention) each query sees only the listed
tokens of its sequence (-1 = empty slot), still causally.

Shapes: T queries, H heads, R kv_lora_rank, Dr rope dim, P pages, S page size, K top-k.
"""

from __future__ import annotations

import torch

from kernels.paged_gather import causal_mask, check_tags_ref, gather_sequence_ref


def mla_attention_ref(
    q: torch.Tensor,  # [T, H, R + Dr]
    latent_cache: torch.Tensor,  # [P, S, R + Dr]
    latent_scale: float,
    kv_lora_rank: int,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    softmax_scale: float,
    topk_indices: torch.Tensor | None = None,  # [T, K] int64 token indices within the sequence
    *,
    check_tags: bool = True,  # False only to measure the check's cost (no tag is read)
) -> torch.Tensor:  # [T, H, R]
    ok = check_tags_ref(
        page_tags, page_table, expected_tags, seq_lens, latent_cache.shape[1], tag_mismatch, check_tags
    )
    T, H, _ = q.shape
    out = torch.zeros(T, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        q0, q1, L = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b])
        if q1 == q0:
            continue
        kv, valid = gather_sequence_ref(latent_cache, latent_scale, page_table[b], ok[b], L)  # [L, R+Dr]
        scores = torch.einsum("qhc,lc->hql", q[q0:q1].float(), kv) * softmax_scale  # [H, Q, L]
        allowed = causal_mask(q1 - q0, L, q.device) & valid[None, :]  # [Q, L]
        if topk_indices is not None:
            idx = topk_indices[q0:q1].long()  # [Q, K]
            selected = torch.zeros(q1 - q0, L + 1, dtype=torch.bool, device=q.device)
            selected.scatter_(1, torch.where(idx < 0, L, idx.clamp(max=L)), True)  # column L absorbs -1
            allowed &= selected[:, :L]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hql,lr->qhr", probs, kv[:, :kv_lora_rank])
    return out.to(q.dtype)

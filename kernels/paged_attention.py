"""GQA attention over the paged K/V cache, for prefill chunks and decode alike (reference op).

Each sequence's new queries (rows `query_start[b]:query_start[b+1]`) are its last tokens; they
attend causally to all `seq_lens[b]` cached tokens (the prefix plus themselves, already written by
`kv_write`). Every page is tag-checked first; a page that fails contributes nothing and flags
`tag_mismatch[b]`. Computed in float32, returned in q's dtype.

Shapes: T query tokens, Hq query heads, Hkv kv heads, D head dim, Dv value dim, P pages, S page size.
"""

from __future__ import annotations

import torch

from kernels.paged_gather import causal_mask, check_tags_ref, gather_sequence_ref


def paged_attention_ref(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [P, S, Hkv, D]
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    k_scale: float,
    v_scale: float,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    softmax_scale: float,
    *,
    check_tags: bool = True,  # False only to measure the check's cost (no tag is read)
) -> torch.Tensor:  # [T, Hq, Dv]
    ok = check_tags_ref(
        page_tags, page_table, expected_tags, seq_lens, k_cache.shape[1], tag_mismatch, check_tags
    )
    T, Hq, _ = q.shape
    Hkv, Dv = v_cache.shape[2], v_cache.shape[3]
    out = torch.zeros(T, Hq, Dv, dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        q0, q1, L = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b])
        if q1 == q0:
            continue
        k, valid = gather_sequence_ref(k_cache, k_scale, page_table[b], ok[b], L)  # [L, Hkv, D]
        v, _ = gather_sequence_ref(v_cache, v_scale, page_table[b], ok[b], L)  # [L, Hkv, Dv]
        k = k.repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        v = v.repeat_interleave(Hq // Hkv, dim=1)
        scores = torch.einsum("qhd,lhd->hql", q[q0:q1].float(), k) * softmax_scale  # [Hq, Q, L]
        allowed = causal_mask(q1 - q0, L, q.device) & valid[None, :]  # [Q, L]
        scores = scores.masked_fill(~allowed[None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing allowed gives 0
        out[q0:q1] = torch.einsum("hql,lhd->qhd", probs, v)
    return out.to(q.dtype)

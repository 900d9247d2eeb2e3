"""GQA attention over the paged K/V cache, for prefill chunks and decode alike: the op's public entry
`paged_attention(args)` (the Triton kernels of `kernels/paged_decode_gqa.py` /
`kernels/paged_prefill_gqa.py` on CUDA, the torch reference `paged_attention_ref` elsewhere).

Each sequence's new queries (rows `query_start[b]:query_start[b+1]`) are its last tokens; they
attend causally to all `seq_lens[b]` cached tokens (the prefix plus themselves, already written by
`kv_write`). The reference tag-checks every page first; a page that fails contributes nothing and
flags `tag_mismatch[b]` (the Triton kernels check after an unchecked pass and redo what it read of a
bad page: `kernels/gqa_slice.py`, `docs/security.md`). Computed in float32, returned in q's dtype.

Shapes: T query tokens, Hq query heads, Hkv kv heads, D head dim, Dv value dim, P pages, S page size.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_gather import PagedBatch, causal_mask, check_tags_ref, gather_sequence_ref


@dataclass(frozen=True, slots=True)
class PagedAttentionArgs:
    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [P, S, Hkv, D] q's dtype or float8_e4m3fn
    v_cache: torch.Tensor  # [P, S, Hkv, Dv]
    k_scale: float
    v_scale: float
    softmax_scale: float
    batch: PagedBatch


def paged_attention(args: PagedAttentionArgs) -> torch.Tensor:  # [T, Hq, Dv]
    """The op: the split-K decode and the prefill kernels on CUDA (triton is the gpu extra: imported
    only there), `paged_attention_ref` elsewhere."""
    a, b = args, args.batch
    if a.q.is_cuda and b.is_decode:  # decode: T = B
        from kernels.paged_decode_gqa import paged_decode_gqa

        return paged_decode_gqa(
            a.q, a.k_cache, a.v_cache, a.k_scale, a.v_scale, b.seq_lens, b.page_table, b.expected_tags,
            b.page_tags, b.tag_mismatch, a.softmax_scale, check_tags=b.check_tags,
        )  # fmt: skip
    if a.q.is_cuda:  # prefill chunks (and mixed steps)
        from kernels.paged_prefill_gqa import paged_prefill_gqa

        return paged_prefill_gqa(
            a.q, a.k_cache, a.v_cache, a.k_scale, a.v_scale, b.query_start, b.seq_lens, b.page_table,
            b.expected_tags, b.page_tags, b.tag_mismatch, a.softmax_scale, check_tags=b.check_tags, memo=b.memo,
        )  # fmt: skip
    return paged_attention_ref(
        a.q, a.k_cache, a.v_cache, a.k_scale, a.v_scale, b.query_start, b.seq_lens, b.page_table,
        b.expected_tags, b.page_tags, b.tag_mismatch, a.softmax_scale, check_tags=b.check_tags,
    )  # fmt: skip


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


def paged_decode_gqa_ref(
    q: torch.Tensor,  # [B, Hq, D]
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: float,
    v_scale: float,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    page_tags: torch.Tensor,
    tag_mismatch: torch.Tensor,
    softmax_scale: float,
) -> torch.Tensor:
    """The paged attention reference op with one query per sequence."""
    query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(
        q, k_cache, v_cache, k_scale, v_scale, query_start, seq_lens, page_table,
        expected_tags, page_tags, tag_mismatch, softmax_scale,
    )  # fmt: skip

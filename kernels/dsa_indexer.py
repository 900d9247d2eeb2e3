"""DeepSeek Sparse Attention indexer: score every cached token for each query, keep the top k.

`score[t, j] = Σ_h w[t, h] · relu(q[t, h] · k[j] · softmax_scale)` over the indexer heads, with the
indexer keys read from their own paged cache (tag-checked like every page read). Tokens a query
may not see (later tokens, pages that failed their check) are never chosen; a query with fewer than
k visible tokens gets -1 in the remaining slots. Indices are token positions within the sequence.

The op returns the chosen set: the reference best first, the GPU path in no particular order, -1
slots anywhere (sparse MLA, the consumer, takes the positions as a set; sorting them cost as much as
choosing them). Equal scores go to the earlier token (`top_positions`). Ties are common, not a corner case: a key
that every head's ReLU zeroes scores exactly 0, and with few heads many keys do. `torch.topk` leaves
the order of ties unspecified and its pick among them changes with the row's length, so a query's
choice would depend on how many columns its row has (a prefill chunk, the page table's width, the
length of a full forward) and a cached decode could not reproduce a prefill of the same tokens.

The op's public entry is `dsa_indexer(args)`: Triton scoring + torch.topk on CUDA
(`kernels/dsa_indexer_triton.py`, no host sync), the torch reference `dsa_indexer_ref` elsewhere.

Shapes: T queries, Hi indexer heads, Di indexer head dim, P pages, S page size, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_gather import PagedBatch, causal_mask, check_tags_ref, gather_sequence_ref
from kernels.selection import top_positions


@dataclass(frozen=True, slots=True)
class DsaIndexerArgs:
    q: torch.Tensor  # [T, Hi, Di] rotated indexer queries
    weights: torch.Tensor  # [T, Hi] float32 per-head weights
    k_cache: torch.Tensor  # [P, S, Di] indexer keys, q's dtype or float8_e4m3fn
    k_scale: float
    softmax_scale: float
    topk: int  # K
    batch: PagedBatch


def dsa_indexer(args: DsaIndexerArgs) -> torch.Tensor:  # [T, K] int64, a set per row
    """The op: the Triton scores on CUDA (triton is the gpu extra: imported only there), the
    reference elsewhere."""
    a, b = args, args.batch
    inputs = (
        a.q, a.weights, a.k_cache, a.k_scale, b.query_start, b.seq_lens, b.page_table, b.expected_tags,
        b.page_tags, b.tag_mismatch, a.softmax_scale, a.topk,
    )  # fmt: skip
    if not a.q.is_cuda:
        return dsa_indexer_ref(*inputs, check_tags=b.check_tags)
    from kernels.dsa_indexer_triton import dsa_indexer_triton, indexer_tiles

    T, Hi = a.q.shape[:2]
    key = ("dsa_indexer_tiles", T, Hi)  # the same for every indexer layer of the step: made once
    if key not in b.memo:
        b.memo[key] = indexer_tiles(b.query_start, T, b.seq_lens.shape[0], Hi)
    return dsa_indexer_triton(*inputs, check_tags=b.check_tags, tiles=b.memo[key])


def dsa_indexer_ref(
    q: torch.Tensor,  # [T, Hi, Di] rotated indexer queries
    weights: torch.Tensor,  # [T, Hi] float32 per-head weights
    k_cache: torch.Tensor,  # [P, S, Di] indexer keys
    k_scale: float,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    softmax_scale: float,
    topk: int,
    *,
    check_tags: bool = True,  # False only to measure the check's cost (no tag is read)
) -> torch.Tensor:  # [T, K] int64
    ok = check_tags_ref(
        page_tags, page_table, expected_tags, seq_lens, k_cache.shape[1], tag_mismatch, check_tags
    )
    T = q.shape[0]
    out = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    for b in range(seq_lens.shape[0]):
        q0, q1, L = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b])
        if q1 == q0:
            continue
        k, valid = gather_sequence_ref(k_cache, k_scale, page_table[b], ok[b], L)  # [L, Di]
        per_head = torch.relu(torch.einsum("qhd,ld->qhl", q[q0:q1].float(), k) * softmax_scale)  # [Q, Hi, L]
        scores = torch.einsum("qh,qhl->ql", weights[q0:q1].float(), per_head)  # [Q, L]
        allowed = causal_mask(q1 - q0, L, q.device) & valid[None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        out[q0:q1, : min(topk, L)] = top_positions(scores, min(topk, L))
    return out

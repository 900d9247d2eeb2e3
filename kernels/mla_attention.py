"""Multi-head latent attention over the paged latent cache, with absorbed weights: the op's public
entry `mla_attention(args)` (the Triton kernels of `kernels/mla_decode.py` / `kernels/mla_prefill.py`
on CUDA, the torch reference `mla_attention_ref` elsewhere).

The cache holds one `[kv_lora_rank + rope_dim]` line per token (576 for DeepSeek-V3 / Kimi K2):
the normalised latent `c` then the rotated `k_pe`. Queries come already absorbed:
`q = [q_nope · W_UK | q_pe]` per head, so attention is MQA with one shared "head": the key is the
whole cache line and the value is its first `kv_lora_rank` dims. The caller multiplies the latent
output by W_UV. With `topk_indices` (DeepSeek Sparse Attention) each query sees only the listed
tokens of its sequence (-1 = empty slot), still causally.

Shapes: T queries, H heads, R kv_lora_rank, Dr rope dim, P pages, S page size, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.paged_gather import PagedBatch, causal_mask, check_tags_ref, gather_sequence_ref


@dataclass(frozen=True, slots=True)
class MlaAttentionArgs:
    q: torch.Tensor  # [T, H, R + Dr] absorbed queries
    latent_cache: torch.Tensor  # [P, S, R + Dr] q's dtype or float8_e4m3fn
    latent_scale: float
    kv_lora_rank: int  # R
    softmax_scale: float
    batch: PagedBatch
    topk_indices: torch.Tensor | None = None  # [T, K] int64 DSA's chosen tokens; None: all visible
    fp8_dot: bool = False  # an FP8 cache on CUDA: e4m3 dots, q and p rounded (`mla_decode`); not a default


def mla_attention(args: MlaAttentionArgs) -> torch.Tensor:  # [T, H, R]
    """The op: decode and prefill kernels on CUDA (triton is the gpu extra: imported only there),
    `mla_attention_ref` elsewhere."""
    a, b = args, args.batch
    if a.q.is_cuda and b.is_decode:  # decode: T = B
        from kernels.mla_decode import mla_decode

        return mla_decode(
            a.q, a.latent_cache, a.latent_scale, a.kv_lora_rank, b.seq_lens, b.page_table, b.expected_tags,
            b.page_tags, b.tag_mismatch, a.softmax_scale, a.topk_indices, check_tags=b.check_tags,
            fp8_dot=a.fp8_dot,
        )  # fmt: skip
    if a.q.is_cuda:  # prefill chunks (and mixed steps)
        from kernels.mla_prefill import mla_prefill

        return mla_prefill(
            a.q, a.latent_cache, a.latent_scale, a.kv_lora_rank, b.query_start, b.seq_lens, b.page_table,
            b.expected_tags, b.page_tags, b.tag_mismatch, a.softmax_scale, a.topk_indices,
            check_tags=b.check_tags, fp8_dot=a.fp8_dot, memo=b.memo,
        )  # fmt: skip
    if a.fp8_dot:
        raise ValueError("fp8_dot runs the CUDA kernels only: the reference has no e4m3 dots")
    return mla_attention_ref(
        a.q, a.latent_cache, a.latent_scale, a.kv_lora_rank, b.query_start, b.seq_lens, b.page_table,
        b.expected_tags, b.page_tags, b.tag_mismatch, a.softmax_scale, a.topk_indices, check_tags=b.check_tags,
    )  # fmt: skip


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


def mla_decode_ref(
    q: torch.Tensor,  # [B, H, R + Dr]
    latent_cache: torch.Tensor,
    latent_scale: float,
    kv_lora_rank: int,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    page_tags: torch.Tensor,
    tag_mismatch: torch.Tensor,
    softmax_scale: float,
    topk_indices: torch.Tensor | None = None,
) -> torch.Tensor:
    """The MLA attention reference op with one query per sequence."""
    query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return mla_attention_ref(
        q, latent_cache, latent_scale, kv_lora_rank, query_start, seq_lens, page_table,
        expected_tags, page_tags, tag_mismatch, softmax_scale, topk_indices,
    )  # fmt: skip

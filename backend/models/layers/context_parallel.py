"""Decode context parallelism (DCP) for MLA: the latent KV cache sharded by token over dcp ranks.

Without DCP every tp rank holds the whole latent cache (one latent is shared by all heads, so
splitting heads does not split it). With DCP a group of dcp consecutive ranks shares one copy:

Layout — token t of a sequence lives on group rank `t % dcp`, at local index `t // dcp`, and
`page_table[b, i]` names, on every rank of the group, the page holding the sequence's local tokens
[i·S, (i+1)·S): one page id stands for the S·dcp consecutive tokens [i·S·dcp, (i+1)·S·dcp), S of
them on each rank. So the block manager keeps ONE page table per sequence with pages of S·dcp
tokens (prefix caching and tags unchanged), one broadcast serves every rank, and each rank holds
⌈L/dcp⌉ or ⌊L/dcp⌋ tokens of every sequence: decode attention (as slow as the slowest rank) is
balanced to one token, for short sequences as for long, and the decode writes rotate over the
ranks. Splitting by pages instead (page i on rank i % dcp) would need a page table per rank or
leave dcp−1 of every page id unused, and balance only to a page. Under DCP `batch.slot_mapping` is
not read: each rank derives where its new tokens go from the page table (`local_writes`).

Page tags per shard: each rank keeps its own `page_tags` and checks its pages where it reads and
writes them; a stale page on one rank drops its tokens there and flags the sequence in that rank's
`tag_mismatch` (the runtime OR-reduces the flags over the ranks before sampling).

Attention (`dcp_mla_attention`): the queries of the group's heads are all-gathered, each rank
attends over its shard giving an output normalised over the shard and its log-sum-exp, the lse are
all-gathered, each rank weighs its output by exp(lse_r − lse) with lse = logsumexp over the ranks,
and a reduce-scatter over heads sums the weighted outputs, leaving each rank its own heads — the
split-K merge across GPUs. A reduce-scatter sends (dcp−1)/dcp of the outputs per rank where an
all-gather of (out, lse) would receive dcp−1 times them.

DSA (`dcp_indexer_topk`): the indexer keys are sharded the same way; each rank scores its keys,
keeps its own top-k (scores and global token indices), and the all-gathered per-shard top-k merge
into the exact global top-k (every global top-k token is in its shard's top-k).

Shapes: T queries, H heads (Hg of the group, Hl of this rank), R kv_lora_rank, Dr rope dim, C = R + Dr,
P pages, S page size, B sequences, K top-k, L tokens of a sequence (Lr of them on this rank).
"""

from __future__ import annotations

import torch

from backend.engine.forward_batch import ForwardBatch
from backend.models.layers.parallel import DcpGroup
from kernels.paged_gather import check_tags_ref, gather_sequence_ref


def local_lens(seq_lens: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """[B] tokens of each sequence on group rank `rank`: those t < L with t % size == rank."""
    return ((seq_lens.long() - rank + size - 1) // size).clamp(min=0)


def local_writes(
    batch: ForwardBatch, token_seq: torch.Tensor, rank: int, size: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(slot_mapping [T], this rank's slot or -1 for other ranks' tokens and for rows the batch's
    own `slot_mapping` marks -1 (rows whose KV is already cached, a speculative catch-up's gap: they
    write nothing); the tag each destination page must carry [T], or None with the tag check off).
    Any other value of the batch's slot is ignored: each rank derives its slot from the page table."""
    qs = batch.query_start.long()
    q_lens = qs[1:] - qs[:-1]
    offset = torch.arange(batch.num_tokens, device=qs.device) - qs[token_seq]
    token_idx = (batch.seq_lens.long() - q_lens)[token_seq] + offset  # [T] within its sequence
    S = batch.kv_cache.page_size
    local = token_idx // size
    col = (local // S).clamp(max=batch.page_table.shape[1] - 1)
    slots = batch.page_table[token_seq, col].long() * S + local % S
    slots = torch.where((token_idx % size == rank) & (batch.slot_mapping >= 0), slots, -1)
    expected = batch.expected_tags[token_seq, col] if batch.check_tags else None
    return slots, expected


def mla_attention_shard_ref(
    q: torch.Tensor,  # [T, H, R + Dr] absorbed queries
    latent_cache: torch.Tensor,  # [P, S, R + Dr] this rank's shard
    latent_scale: float,
    kv_lora_rank: int,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, whole sequences (all shards)
    page_table: torch.Tensor,  # [B, Mp] int32, pages of local tokens
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64 this rank's tags
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    softmax_scale: float,
    rank: int,
    size: int,
    topk_indices: torch.Tensor | None = None,  # [T, K] int64 global token indices, -1 = empty
    *,
    check_tags: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # out [T, H, R] float32 (normalised over the shard), lse [T, H]
    """`mla_attention_ref` over one rank's token shard, with the shard's log-sum-exp for the merge
    (−inf, and a zero output, where a query sees no token of the shard)."""
    lens = local_lens(seq_lens, rank, size)
    ok = check_tags_ref(
        page_tags, page_table, expected_tags, lens, latent_cache.shape[1], tag_mismatch, check_tags
    )
    T, H, _ = q.shape
    out = torch.zeros(T, H, kv_lora_rank, dtype=torch.float32, device=q.device)
    lse = torch.full((T, H), float("-inf"), dtype=torch.float32, device=q.device)
    for b in range(seq_lens.shape[0]):
        q0, q1, L, Lr = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b]), int(lens[b])
        if q1 == q0 or Lr == 0:
            continue
        kv, valid = gather_sequence_ref(latent_cache, latent_scale, page_table[b], ok[b], Lr)  # [Lr, C]
        pos = torch.arange(L - (q1 - q0), L, device=q.device)  # [Q] the queries are the last Q tokens
        token = torch.arange(Lr, device=q.device) * size + rank  # [Lr] global index of each local token
        allowed = (token[None, :] <= pos[:, None]) & valid[None, :]  # [Q, Lr]
        if topk_indices is not None:
            idx = topk_indices[q0:q1].long()  # [Q, K]
            selected = torch.zeros(q1 - q0, L + 1, dtype=torch.bool, device=q.device)
            selected.scatter_(1, torch.where(idx < 0, L, idx.clamp(max=L)), True)  # column L absorbs -1
            allowed &= selected[:, token]
        scores = torch.einsum("qhc,lc->qhl", q[q0:q1].float(), kv) * softmax_scale  # [Q, H, Lr]
        scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
        shard_lse = torch.logsumexp(scores, dim=-1)  # [Q, H]
        probs = torch.exp(scores - shard_lse[..., None]).nan_to_num(0.0)  # all -inf rows: 0
        out[q0:q1] = torch.einsum("qhl,lr->qhr", probs, kv[:, :kv_lora_rank])
        lse[q0:q1] = shard_lse
    return out, lse


def merge_weights(lses: torch.Tensor) -> torch.Tensor:
    """lses [N, T, H] of N shards → each shard's weight exp(lse_r − logsumexp_r lse_r) [N, T, H];
    zero where no shard saw a token (the single-rank op's output is zero there too)."""
    total = torch.logsumexp(lses, dim=0)  # [T, H]
    return torch.exp(lses - total).nan_to_num(0.0)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """outs [N, T, H, R], lses [N, T, H] → the attention over all N shards [T, H, R] float32."""
    return (outs * merge_weights(lses)[..., None]).sum(0)


def dcp_mla_attention(
    q: torch.Tensor,  # [T, Hl, R + Dr] this rank's heads
    batch: ForwardBatch,
    layer_idx: int,
    kv_lora_rank: int,
    softmax_scale: float,
    topk_indices: torch.Tensor | None,
    dcp: DcpGroup,
) -> torch.Tensor:  # [T, Hl, R]
    kv = batch.kv_cache
    T, Hl, C = q.shape
    q_group = dcp.all_gather(q).permute(1, 0, 2, 3).reshape(T, dcp.size * Hl, C)  # [T, Hg, C]
    out, lse = mla_attention_shard_ref(
        q_group, kv.layers[layer_idx]["latent"], kv.scales[layer_idx]["latent"], kv_lora_rank,
        batch.query_start, batch.seq_lens, batch.page_table, batch.expected_tags, kv.page_tags,
        batch.tag_mismatch, softmax_scale, dcp.rank, dcp.size, topk_indices, check_tags=batch.check_tags,
    )  # fmt: skip
    weight = merge_weights(dcp.all_gather(lse))[dcp.rank]  # [T, Hg]
    part = (out * weight[..., None]).view(T, dcp.size, Hl, kv_lora_rank).transpose(0, 1)  # [N, T, Hl, R]
    return dcp.reduce_scatter(part).to(q.dtype)


def dsa_indexer_shard_ref(
    q: torch.Tensor,  # [T, Hi, Di] rotated indexer queries
    weights: torch.Tensor,  # [T, Hi] float32 per-head weights
    k_cache: torch.Tensor,  # [P, S, Di] this rank's shard of the indexer keys
    k_scale: float,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, whole sequences
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64 this rank's tags
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    softmax_scale: float,
    topk: int,
    rank: int,
    size: int,
    *,
    check_tags: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:  # scores [T, K] float32 (−inf = empty), global indices [T, K]
    """`dsa_indexer_ref`'s scores over one rank's key shard; its top-k with their scores."""
    lens = local_lens(seq_lens, rank, size)
    ok = check_tags_ref(
        page_tags, page_table, expected_tags, lens, k_cache.shape[1], tag_mismatch, check_tags
    )
    T = q.shape[0]
    values = torch.full((T, topk), float("-inf"), dtype=torch.float32, device=q.device)
    indices = torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    for b in range(seq_lens.shape[0]):
        q0, q1, L, Lr = int(query_start[b]), int(query_start[b + 1]), int(seq_lens[b]), int(lens[b])
        if q1 == q0 or Lr == 0:
            continue
        k, valid = gather_sequence_ref(k_cache, k_scale, page_table[b], ok[b], Lr)  # [Lr, Di]
        per_head = torch.relu(torch.einsum("qhd,ld->qhl", q[q0:q1].float(), k) * softmax_scale)  # [Q, Hi, Lr]
        scores = torch.einsum("qh,qhl->ql", weights[q0:q1].float(), per_head)  # [Q, Lr]
        pos = torch.arange(L - (q1 - q0), L, device=q.device)
        token = torch.arange(Lr, device=q.device) * size + rank
        allowed = (token[None, :] <= pos[:, None]) & valid[None, :]
        scores = scores.masked_fill(~allowed, float("-inf"))
        k_eff = min(topk, Lr)
        top = scores.topk(k_eff, dim=-1)
        values[q0:q1, :k_eff] = top.values
        indices[q0:q1, :k_eff] = torch.where(torch.isinf(top.values), -1, token[top.indices])
    return values, indices


def merge_topk(values: torch.Tensor, indices: torch.Tensor, topk: int) -> torch.Tensor:
    """Per-shard top-k, values / indices [N, T, K] → the global top-k indices [T, K] (-1 = empty)."""
    N, T, K = values.shape
    flat_values = values.permute(1, 0, 2).reshape(T, N * K)
    flat_indices = indices.permute(1, 0, 2).reshape(T, N * K)
    top = flat_values.topk(topk, dim=-1)
    return torch.where(torch.isinf(top.values), -1, flat_indices.gather(1, top.indices))


def dcp_indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    batch: ForwardBatch,
    layer_idx: int,
    softmax_scale: float,
    topk: int,
    dcp: DcpGroup,
) -> torch.Tensor:  # [T, K] int64 global token indices, -1 = empty
    kv = batch.kv_cache
    values, indices = dsa_indexer_shard_ref(
        q, weights, kv.layers[layer_idx]["index_k"], kv.scales[layer_idx]["index_k"], batch.query_start,
        batch.seq_lens, batch.page_table, batch.expected_tags, kv.page_tags, batch.tag_mismatch,
        softmax_scale, topk, dcp.rank, dcp.size, check_tags=batch.check_tags,
    )  # fmt: skip
    return merge_topk(dcp.all_gather(values), dcp.all_gather(indices), topk)

"""DCP math in pure torch: per-shard MLA attention merged by log-sum-exp, and per-shard DSA top-k
merged, equal the single-rank reference ops over the whole cache (no process group needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from backend.models.layers.context_parallel import (
    dsa_indexer_shard_ref,
    local_lens,
    local_writes,
    merge_partials,
    merge_topk,
    mla_attention_shard_ref,
)
from kernels.dsa_indexer import dsa_indexer_ref
from kernels.mla_attention import mla_attention_ref

S = 4  # page size
SEQ_LENS = (1, 6, 17, 40)  # a first token, a page-crossing few, a long one
Q_LENS = (1, 1, 5, 40)  # decode, decode, a prefill chunk, a whole prefill
C, R, H = 24, 16, 3


class Paged:
    """One cache (the whole sequences, or rank r's shard of them) with its page table and tags."""

    def __init__(self, per_seq: list[torch.Tensor], rank: int, size: int) -> None:
        lens = local_lens(torch.tensor([len(v) for v in per_seq]), rank, size).tolist()
        width = max(max(-(-n // S) for n in lens), 1)
        num_pages = sum(-(-n // S) for n in lens) + 1
        self.cache = torch.zeros(num_pages, S, per_seq[0].shape[1])
        self.tags = torch.arange(num_pages) * 5 + 11 + rank  # each rank's own tags
        self.table = torch.zeros(len(per_seq), width, dtype=torch.int32)
        self.expected = torch.full((len(per_seq), width), -1, dtype=torch.int64)
        next_page = 1  # page 0 unused: a zero-padded table entry must not alias a live page
        for b, (values, n) in enumerate(zip(per_seq, lens, strict=True)):
            for i in range(-(-n // S)):
                self.table[b, i], self.expected[b, i] = next_page, self.tags[next_page]
                next_page += 1
            local = values[rank::size]  # tokens t with t % size == rank, in order
            for j in range(n):
                self.cache[int(self.table[b, j // S]), j % S] = local[j]


def _batch(seed: int, dim: int) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_seq = [torch.randn(n, dim, generator=g) for n in SEQ_LENS]
    query_start = torch.tensor([0, *torch.tensor(Q_LENS).cumsum(0).tolist()], dtype=torch.int32)
    return per_seq, query_start, torch.tensor(SEQ_LENS, dtype=torch.int32)


def _topk(seed: int, K: int) -> torch.Tensor:
    """Random token choices per query (some beyond the query, some empty), as the indexer gives."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for L, Q in zip(SEQ_LENS, Q_LENS, strict=True):
        idx = torch.randint(0, L, (Q, K), generator=g)
        rows.append(torch.where(torch.rand(Q, K, generator=g) < 0.2, -1, idx))
    return torch.cat(rows)


@pytest.mark.parametrize("size", [2, 3, 4])
@pytest.mark.parametrize("sparse", [False, True])
def test_shard_attention_merged_by_lse_equals_single_rank(size: int, sparse: bool) -> None:
    per_seq, query_start, seq_lens = _batch(0, C)
    q = torch.randn(sum(Q_LENS), H, C, generator=torch.Generator().manual_seed(1))
    topk = _topk(2, 6) if sparse else None
    whole = Paged(per_seq, 0, 1)
    flags = torch.zeros(len(SEQ_LENS), dtype=torch.bool)
    expected = mla_attention_ref(
        q, whole.cache, 1.0, R, query_start, seq_lens, whole.table, whole.expected, whole.tags, flags,
        0.3, topk,
    )  # fmt: skip
    outs, lses = [], []
    for rank in range(size):
        shard = Paged(per_seq, rank, size)
        o, lse = mla_attention_shard_ref(
            q, shard.cache, 1.0, R, query_start, seq_lens, shard.table, shard.expected, shard.tags,
            flags, 0.3, rank, size, topk,
        )  # fmt: skip
        outs.append(o)
        lses.append(lse)
    merged = merge_partials(torch.stack(outs), torch.stack(lses))
    assert not flags.any()
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)
    # rank `size - 1` holds no token of the 1-token sequence: its share there is empty, not NaN
    assert torch.isinf(lses[-1][0]).all() and not outs[-1].isnan().any()


def test_a_stale_page_on_one_shard_flags_its_sequence_there_only() -> None:
    per_seq, query_start, seq_lens = _batch(0, C)
    q = torch.randn(sum(Q_LENS), H, C)
    shards = [Paged(per_seq, rank, 2) for rank in range(2)]
    shards[1].tags[int(shards[1].table[2, 0])] += 1  # sequence 2's first page on rank 1 reallocated
    flags = [torch.zeros(len(SEQ_LENS), dtype=torch.bool) for _ in shards]
    parts = [
        mla_attention_shard_ref(
            q, s.cache, 1.0, R, query_start, seq_lens, s.table, s.expected, s.tags, f, 0.3, rank, 2
        )
        for rank, (s, f) in enumerate(zip(shards, flags, strict=True))
    ]
    assert flags[0].tolist() == [False] * 4 and flags[1].tolist() == [False, False, True, False]
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    whole = Paged(per_seq, 0, 1)
    expected = mla_attention_ref(
        q, whole.cache, 1.0, R, query_start, seq_lens, whole.table, whole.expected, whole.tags,
        torch.zeros(4, dtype=torch.bool), 0.3,
    )  # fmt: skip
    rows = torch.arange(sum(Q_LENS))
    other = (rows < query_start[2]) | (rows >= query_start[3])  # every query but sequence 2's
    torch.testing.assert_close(merged[other], expected[other], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(merged[~other], expected[~other], atol=1e-3)  # the stale page left out


@pytest.mark.parametrize("size", [2, 4])
def test_shard_top_k_merge_into_the_exact_global_top_k(size: int) -> None:
    Hi, Di, K = 4, 8, 6
    per_seq, query_start, seq_lens = _batch(3, Di)
    g = torch.Generator().manual_seed(4)
    q = torch.randn(sum(Q_LENS), Hi, Di, generator=g)
    weights = torch.randn(sum(Q_LENS), Hi, generator=g)
    whole = Paged(per_seq, 0, 1)
    flags = torch.zeros(len(SEQ_LENS), dtype=torch.bool)
    expected = dsa_indexer_ref(
        q, weights, whole.cache, 1.0, query_start, seq_lens, whole.table, whole.expected, whole.tags,
        flags, 0.5, K,
    )  # fmt: skip
    values, indices = [], []
    for rank in range(size):
        shard = Paged(per_seq, rank, size)
        v, i = dsa_indexer_shard_ref(
            q, weights, shard.cache, 1.0, query_start, seq_lens, shard.table, shard.expected, shard.tags,
            flags, 0.5, K, rank, size,
        )  # fmt: skip
        values.append(v)
        indices.append(i)
    merged = merge_topk(torch.stack(values), torch.stack(indices), K)
    assert not flags.any()
    # the same set per query (the order of the kept tokens carries no meaning), -1 padding included
    assert torch.equal(merged.sort(-1).values, expected.sort(-1).values)
    assert (expected >= 0).sum() > len(expected) * 3  # most queries keep several tokens


def test_with_the_tag_check_off_no_tag_is_read() -> None:
    per_seq, query_start, seq_lens = _batch(0, C)
    q = torch.randn(sum(Q_LENS), H, C)
    whole = Paged(per_seq, 0, 1)
    no_flags = torch.zeros(len(SEQ_LENS), dtype=torch.bool)
    expected = mla_attention_ref(
        q, whole.cache, 1.0, R, query_start, seq_lens, whole.table, whole.expected, whole.tags, no_flags, 0.3
    )
    shards = [Paged(per_seq, rank, 2) for rank in range(2)]
    shards[1].tags += 1  # every page on rank 1 stale: unseen with the check off
    flags = torch.zeros(len(SEQ_LENS), dtype=torch.bool)
    parts = [
        mla_attention_shard_ref(
            q, s.cache, 1.0, R, query_start, seq_lens, s.table, s.expected, s.tags, flags, 0.3, rank, 2,
            check_tags=False,
        )
        for rank, s in enumerate(shards)
    ]  # fmt: skip
    assert not flags.any()
    merged = merge_partials(torch.stack([p[0] for p in parts]), torch.stack([p[1] for p in parts]))
    torch.testing.assert_close(merged, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("size", [2, 3])
def test_rows_marked_minus_one_write_nothing_on_any_rank(size: int) -> None:
    """A speculative catch-up marks its gap's rows -1 (their KV is cached, maybe in pages another
    sequence shares): under DCP no rank writes them; every other row is written by exactly the rank
    that holds its token, at the slot its page table gives, whatever the batch's own slot says."""
    q_lens, seq_lens = [3, 6], [7, 10]  # sequence 1's first 4 new rows are a gap
    T = sum(q_lens)
    table = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    marked = torch.tensor([0, 0, 0, -1, -1, -1, -1, 0, 0])
    batch = SimpleNamespace(
        query_start=torch.tensor([0, 3, 9], dtype=torch.int32),
        num_tokens=T,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        kv_cache=SimpleNamespace(page_size=S),
        page_table=table,
        expected_tags=torch.tensor([[10, 20], [30, 40]]),
        check_tags=True,
        slot_mapping=marked,
    )
    token_seq = torch.tensor([0, 0, 0, 1, 1, 1, 1, 1, 1])
    token_idx = [4, 5, 6, 4, 5, 6, 7, 8, 9]  # within its sequence
    written: list[int] = []
    for rank in range(size):
        slots, expected = local_writes(batch, token_seq, rank, size)  # type: ignore[arg-type]
        assert expected is not None
        for t in range(T):
            local = token_idx[t] // size
            if marked[t] < 0 or token_idx[t] % size != rank:
                assert slots[t] == -1, (rank, t)
            else:
                assert slots[t] == int(table[token_seq[t], local // S]) * S + local % S
                written.append(t)
    assert sorted(written) == [0, 1, 2, 7, 8]

"""DSA indexer reference vs brute-force scoring over contiguous keys."""

from __future__ import annotations

import torch

from kernels.dsa_indexer import dsa_indexer_ref
from kernels.selection import top_positions
from tests.kernels.paged_layout import lay_out, query_starts

Hi, Di, K = 4, 16, 8
SCALE = Di**-0.5


def brute_force(q: torch.Tensor, w: torch.Tensor, k: torch.Tensor, L: int) -> list[set[int]]:
    """Sets of chosen token indices for queries q [Q, Hi, Di] = the last Q tokens of L (a stable sort:
    equal scores, several relu'd to exactly 0, go to the earlier token)."""
    Q = q.shape[0]
    scores = torch.einsum("qh,qhl->ql", w, torch.relu(torch.einsum("qhd,ld->qhl", q, k) * SCALE))
    out = []
    for i in range(Q):
        visible = L - Q + i + 1
        order = scores[i, :visible].sort(descending=True, stable=True).indices
        out.append(set(order[: min(K, visible)].tolist()))
    return out


def run(q, w, paged, num_q):  # type: ignore[no-untyped-def]
    mismatch = torch.zeros(len(num_q), dtype=torch.bool)
    idx = dsa_indexer_ref(
        q,
        w,
        paged.caches[0],
        1.0,
        query_starts(num_q),
        paged.seq_lens,
        paged.page_table,
        paged.expected_tags,
        paged.page_tags,
        mismatch,
        SCALE,
        K,
    )
    return idx, mismatch


def test_chooses_the_top_visible_tokens_and_pads_with_minus_one() -> None:
    g = torch.Generator().manual_seed(0)
    lens, num_q = [33, 5, 20], [33, 5, 1]
    ks = [torch.randn(L, Di, generator=g) for L in lens]
    q = torch.randn(sum(num_q), Hi, Di, generator=g)
    w = torch.randn(sum(num_q), Hi, generator=g)
    paged = lay_out([[k] for k in ks])
    idx, mismatch = run(q, w, paged, num_q)
    assert not mismatch.any() and idx.shape == (sum(num_q), K)
    starts = query_starts(num_q).tolist()
    for b, L in enumerate(lens):
        s, e = starts[b], starts[b + 1]
        for row, want in zip(range(s, e), brute_force(q[s:e], w[s:e], ks[b], L), strict=True):
            got = idx[row]
            assert set(got[got >= 0].tolist()) == want
            assert int((got < 0).sum()) == K - len(want)


def test_tokens_of_a_page_with_the_wrong_tag_are_never_chosen() -> None:
    g = torch.Generator().manual_seed(1)
    L, num_q = 48, [1, 1]
    ks = [torch.randn(L, Di, generator=g) for _ in num_q]
    q, w = torch.randn(2, Hi, Di, generator=g), torch.randn(2, Hi, generator=g)
    paged = lay_out([[k] for k in ks])
    paged.page_tags[paged.pages[0][2]] += 1
    idx, mismatch = run(q, w, paged, num_q)
    assert mismatch.tolist() == [True, False]
    assert not ((idx[0] >= 32) & (idx[0] < 48)).any()
    assert set(idx[1].tolist()) == brute_force(q[1:], w[1:], ks[1], L)[0]


def test_equal_scores_go_to_the_earlier_token_however_the_sequence_is_cut() -> None:
    """By hand: both heads' q = e0; key 0 = 2·e0 (score 2·2·SCALE), key 5 = e0 (2·SCALE), every other
    key −e0 (both heads' ReLU zero it: score exactly 0). Query 11 sees 12 keys: top 4 = 0, 5, then the
    earliest two zeros. The same whether the sequence is one prefill, a prefill then a decode step, or
    sits in a batch beside a longer sequence (a wider page table)."""
    L, k = 12, 4
    keys = -torch.eye(Di)[0].repeat(L, 1)
    keys[0], keys[5] = 2 * torch.eye(Di)[0], torch.eye(Di)[0]
    q = torch.eye(Di)[0].repeat(L, 2, 1)  # [L, 2 heads, Di]
    w = torch.ones(L, 2)
    other = torch.randn(40, Di, generator=torch.Generator().manual_seed(2))

    def last_row(num_q: list[int], seqs: list[torch.Tensor], rows: torch.Tensor) -> list[int]:
        paged = lay_out([[s] for s in seqs])
        out = dsa_indexer_ref(
            rows, torch.ones(rows.shape[0], 2), paged.caches[0], 1.0, query_starts(num_q), paged.seq_lens,
            paged.page_table, paged.expected_tags, paged.page_tags, torch.zeros(len(num_q), dtype=torch.bool),
            SCALE, k,
        )  # fmt: skip
        return out[num_q[0] - 1].tolist()

    prefill = last_row([L], [keys], q)
    assert prefill == [0, 5, 1, 2]
    assert last_row([1], [keys], q[-1:]) == prefill  # decode
    assert last_row([1, 1], [keys, other], torch.cat([q[-1:], q[:1]])) == prefill  # beside 40 tokens
    paged = lay_out([[keys]])
    every = dsa_indexer_ref(
        q, w, paged.caches[0], 1.0, query_starts([L]), paged.seq_lens, paged.page_table, paged.expected_tags,
        paged.page_tags, torch.zeros(1, dtype=torch.bool), SCALE, k,
    )  # fmt: skip
    assert every[3].tolist() == [0, 1, 2, 3] and every[1].tolist() == [0, 1, -1, -1]


def test_top_positions_orders_by_score_then_position() -> None:
    """-0.0 equals 0.0, equal scores go to the earlier column, -inf becomes -1, wider rows change nothing."""
    scores = torch.tensor([[-1.5, 0.0, -0.0, 2.0, 0.0, float("-inf"), -1.5]])
    assert top_positions(scores, 7).tolist() == [[3, 1, 2, 4, 0, 6, -1]]
    wide = torch.cat([scores, torch.full((1, 100), float("-inf"))], dim=1)
    assert top_positions(wide, 5).tolist() == [[3, 1, 2, 4, 0]]


def test_top_positions_unsorted_is_the_same_set() -> None:
    """best_first=False: the sorted choice's set, ties included; with k >= L every column, -1 where -inf."""
    g = torch.Generator().manual_seed(5)
    scores = torch.randint(-3, 4, (6, 40), generator=g).float()  # many ties
    scores[scores == -3] = float("-inf")
    for k in (1, 7, 25, 40, 64):
        best = top_positions(scores, min(k, 40))
        some = top_positions(scores, min(k, 40), best_first=False)
        assert torch.equal(some.sort(dim=1).values, best.sort(dim=1).values), k
    every = top_positions(scores, 40, best_first=False)
    assert torch.equal(every, torch.where(torch.isneginf(scores), -1, torch.arange(40)))

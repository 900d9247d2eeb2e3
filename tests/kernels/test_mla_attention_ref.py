"""Paged absorbed MLA reference vs the naive (expanded K/V per head) MLA of the paper, in float32."""

from __future__ import annotations

import pytest
import torch

from kernels.mla_attention import mla_attention_ref
from tests.kernels.paged_layout import lay_out, query_starts

H, N, Dr, V, R = 4, 16, 8, 24, 32
SCALE = (N + Dr) ** -0.5


def naive(q_nope, q_pe, c, k_pe, w_uk, w_uv, allowed=None):  # type: ignore[no-untyped-def]
    """q_nope [Q,H,N], q_pe [Q,H,Dr], c [L,R], k_pe [L,Dr], w_uk [H,N,R], w_uv [H,V,R] → [Q,H,V]."""
    Q, L = q_nope.shape[0], c.shape[0]
    k_nope = torch.einsum("lr,hnr->lhn", c, w_uk)  # [L, H, N]
    v = torch.einsum("lr,hvr->lhv", c, w_uv)  # [L, H, V]
    scores = (torch.einsum("qhn,lhn->hql", q_nope, k_nope) + torch.einsum("qhd,ld->hql", q_pe, k_pe)) * SCALE
    mask = torch.ones(Q, L, dtype=torch.bool).tril(L - Q)
    if allowed is not None:
        mask &= allowed
    probs = scores.masked_fill(~mask[None], float("-inf")).softmax(-1)
    return torch.einsum("hql,lhv->qhv", probs, v)


def case(L: int, num_q: list[int], seed: int):  # type: ignore[no-untyped-def]
    g = torch.Generator().manual_seed(seed)
    cs = [torch.randn(L, R, generator=g) for _ in num_q]
    pes = [torch.randn(L, Dr, generator=g) for _ in num_q]
    q_nope = torch.randn(sum(num_q), H, N, generator=g)
    q_pe = torch.randn(sum(num_q), H, Dr, generator=g)
    w_uk, w_uv = torch.randn(H, N, R, generator=g) * 0.2, torch.randn(H, V, R, generator=g) * 0.2
    return cs, pes, q_nope, q_pe, w_uk, w_uv


def absorbed(q_nope, q_pe, w_uk, w_uv, paged, num_q, topk=None, scale=1.0):  # type: ignore[no-untyped-def]
    q = torch.cat([torch.einsum("thn,hnr->thr", q_nope, w_uk), q_pe], dim=-1)  # [T, H, R + Dr]
    mismatch = torch.zeros(len(num_q), dtype=torch.bool)
    o = mla_attention_ref(
        q,
        paged.caches[0],
        scale,
        R,
        query_starts(num_q),
        paged.seq_lens,
        paged.page_table,
        paged.expected_tags,
        paged.page_tags,
        mismatch,
        SCALE,
        topk,
    )
    return torch.einsum("thr,hvr->thv", o, w_uv), mismatch


@pytest.mark.parametrize("L", [1, 15, 16, 17, 33, 200])
def test_absorbed_paged_mla_equals_naive_mla(L: int) -> None:
    num_q = [L, 1, min(L, 5)]
    cs, pes, q_nope, q_pe, w_uk, w_uv = case(L, num_q, L)
    paged = lay_out([[torch.cat([c, p], -1)] for c, p in zip(cs, pes, strict=True)])
    out, mismatch = absorbed(q_nope, q_pe, w_uk, w_uv, paged, num_q)
    assert not mismatch.any()
    starts = query_starts(num_q).tolist()
    expected = torch.cat(
        [
            naive(q_nope[s:e], q_pe[s:e], c, p, w_uk, w_uv)
            for s, e, c, p in zip(starts[:-1], starts[1:], cs, pes, strict=True)
        ]
    )
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)


def test_sparse_mode_reads_only_the_listed_tokens() -> None:
    L, num_q, K = 40, [40, 1], 6
    cs, pes, q_nope, q_pe, w_uk, w_uv = case(L, num_q, 7)
    paged = lay_out([[torch.cat([c, p], -1)] for c, p in zip(cs, pes, strict=True)])
    g = torch.Generator().manual_seed(3)
    topk = torch.stack([torch.randperm(L, generator=g)[:K] for _ in range(41)])
    topk[:, -1] = -1  # an empty slot
    out, _ = absorbed(q_nope, q_pe, w_uk, w_uv, paged, num_q, topk)
    for row, (b, q_row) in enumerate([(0, i) for i in range(40)] + [(1, 0)]):
        allowed = torch.zeros(1 if b else 40, L, dtype=torch.bool)
        sel = topk[row][topk[row] >= 0]
        causal_limit = q_row if b == 0 else L - 1
        if not (sel <= causal_limit).any():
            assert torch.equal(out[row], torch.zeros_like(out[row]))  # nothing visible: no contribution
            continue
        allowed[q_row if b == 0 else 0, sel] = True
        s = 0 if b == 0 else 40
        exp = naive(q_nope[s : s + num_q[b]], q_pe[s : s + num_q[b]], cs[b], pes[b], w_uk, w_uv, allowed)
        torch.testing.assert_close(out[row], exp[q_row if b == 0 else 0], atol=1e-5, rtol=1e-4)


def test_wrong_tag_flags_and_masks_the_page() -> None:
    L, num_q = 33, [1, 1]
    cs, pes, q_nope, q_pe, w_uk, w_uv = case(L, num_q, 9)
    paged = lay_out([[torch.cat([c, p], -1)] for c, p in zip(cs, pes, strict=True)])
    clean, _ = absorbed(q_nope, q_pe, w_uk, w_uv, paged, num_q)
    paged.page_tags[paged.pages[1][0]] -= 5
    out, mismatch = absorbed(q_nope, q_pe, w_uk, w_uv, paged, num_q)
    assert mismatch.tolist() == [False, True]
    assert torch.equal(out[0], clean[0])
    allowed = torch.ones(1, L, dtype=torch.bool)
    allowed[0, :16] = False
    torch.testing.assert_close(
        out[1:], naive(q_nope[1:], q_pe[1:], cs[1], pes[1], w_uk, w_uv, allowed), atol=1e-5, rtol=1e-4
    )


def test_fp8_latent_cache_is_close() -> None:
    L, num_q = 33, [33]
    cs, pes, q_nope, q_pe, w_uk, w_uv = case(L, num_q, 11)
    line = torch.cat([cs[0], pes[0]], -1)
    scale = float(line.abs().max()) / 448
    paged = lay_out([[line]], dtype=torch.float8_e4m3fn, scales=[scale])
    out, _ = absorbed(q_nope, q_pe, w_uk, w_uv, paged, num_q, scale=scale)
    exact = naive(q_nope, q_pe, cs[0], pes[0], w_uk, w_uv)
    assert float((out - exact).norm() / exact.norm()) < 0.08

"""Paged GQA attention reference vs plain attention (torch SDPA) on contiguous K/V."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels.paged_attention import paged_attention_ref
from tests.kernels.paged_layout import lay_out, query_starts

Hq, Hkv, D = 4, 2, 16
SCALE = D**-0.5


def plain(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None = None
) -> torch.Tensor:
    """q [Q, Hq, D] = the last Q tokens; k, v [L, Hkv, D] → [Q, Hq, D] via SDPA."""
    Q, L = q.shape[0], k.shape[0]
    mask = torch.ones(Q, L, dtype=torch.bool).tril(L - Q)
    if allowed is not None:
        mask &= allowed[None, :]
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=SCALE, enable_gqa=True
    )
    return out.transpose(0, 1)


def run(q: torch.Tensor, paged, num_q: list[int], v_scale: float = 1.0, k_scale: float = 1.0):  # type: ignore[no-untyped-def]
    mismatch = torch.zeros(len(num_q), dtype=torch.bool)
    out = paged_attention_ref(
        q,
        paged.caches[0],
        paged.caches[1],
        k_scale,
        v_scale,
        query_starts(num_q),
        paged.seq_lens,
        paged.page_table,
        paged.expected_tags,
        paged.page_tags,
        mismatch,
        SCALE,
    )
    return out, mismatch


@pytest.mark.parametrize("L", [1, 15, 16, 17, 33, 300])
def test_equals_plain_attention(L: int) -> None:
    g = torch.Generator().manual_seed(L)
    # three sequences of length L: a whole prefill, a decode step, a 7-token chunk
    num_q = [L, 1, min(L, 7)]
    ks = [torch.randn(L, Hkv, D, generator=g) for _ in num_q]
    vs = [torch.randn(L, Hkv, D, generator=g) for _ in num_q]
    qs = [torch.randn(n, Hq, D, generator=g) for n in num_q]
    paged = lay_out([[k, v] for k, v in zip(ks, vs, strict=True)])
    out, mismatch = run(torch.cat(qs), paged, num_q)
    assert not mismatch.any()
    expected = torch.cat([plain(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_a_page_with_the_wrong_tag_contributes_nothing_and_flags_only_its_sequence() -> None:
    g = torch.Generator().manual_seed(0)
    L, num_q = 40, [40, 1]
    ks = [torch.randn(L, Hkv, D, generator=g) for _ in num_q]
    vs = [torch.randn(L, Hkv, D, generator=g) for _ in num_q]
    q = torch.randn(sum(num_q), Hq, D, generator=g)
    paged = lay_out([[k, v] for k, v in zip(ks, vs, strict=True)])
    clean, _ = run(q, paged, num_q)
    paged.page_tags[paged.pages[0][1]] += 1  # page 1 of sequence 0 was reallocated to someone else
    out, mismatch = run(q, paged, num_q)
    assert mismatch.tolist() == [True, False]
    torch.testing.assert_close(out[40:], clean[40:], atol=0, rtol=0)
    allowed = torch.ones(L, dtype=torch.bool)
    allowed[16:32] = False
    expected = plain(q[:40], ks[0], vs[0], allowed)
    rows = torch.arange(40) < 16  # queries 16..31 still see tokens 0..15; rows beyond see 0..15 and 32..
    torch.testing.assert_close(out[:40][rows], expected[rows], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[32:40], expected[32:40], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(out).all()


def test_fp8_cache_reads_stored_times_scale() -> None:
    g = torch.Generator().manual_seed(1)
    L, num_q = 33, [33]
    k, v = torch.randn(L, Hkv, D, generator=g), torch.randn(L, Hkv, D, generator=g)
    q = torch.randn(L, Hq, D, generator=g)
    k_scale, v_scale = float(k.abs().max()) / 448, float(v.abs().max()) / 448
    paged = lay_out([[k, v]], dtype=torch.float8_e4m3fn, scales=[k_scale, v_scale])
    out, _ = run(q, paged, num_q, k_scale=k_scale, v_scale=v_scale)
    deq_k = (k / k_scale).to(torch.float8_e4m3fn).float() * k_scale
    deq_v = (v / v_scale).to(torch.float8_e4m3fn).float() * v_scale
    torch.testing.assert_close(out, plain(q, deq_k, deq_v), atol=1e-5, rtol=1e-5)
    exact = plain(q, k, v)
    assert float((out - exact).norm() / exact.norm()) < 0.06

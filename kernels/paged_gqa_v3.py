"""The GQA decode, GQA prefill and DSA scoring kernels as measured on the H200 (2026-11-29, 2026-12-01).

Kept verbatim, only renamed, so that one device run can time them side by side with their
successors (`tiles="…/v3"` in each launcher's tile table); they take the same positional
arguments as the current kernels. Delete this file once that run has confirmed the new defaults.

What the run showed, and why (sm90 SASS from `python -m tests.kernels.sm90_compile --sass`):
- the page-tag check cost +6-7% (decode, prefill) because the main loop kept a run-time branch on
  `num_bad`: its `tok_ok` result is converted between layouts through shared memory every tile
  (4 extra barriers, +23% loop instructions for BF16 tiles of 32 tokens) even when no page is bad;
- the DSA indexer checked every token's tag and masked the key loads with it, so each key load
  waited for a dependent tag gather (+6% at 8k to +29% in prefill);
- FP8 KV converted V through a select after the load (`tl.where` over every element) and computed
  64-bit offsets per element, twice (K and V).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kernels.gqa_slice import count_bad_pages
from kernels.mla_decode import query_tile


@triton.jit
def attend_slice_v3(
    q,  # [ROWS, BLOCK_D] COMPUTE: query rows that share KV head kvh
    row_limit,  # [ROWS] tokens each row may see (CAUSAL only)
    k_ptr,  # [P, S, Hkv, D]
    v_ptr,  # [P, S, Hkv, Dv]
    page_table_ptr,
    expected_ptr,
    page_tags_ptr,
    b,
    kvh,
    start,
    end,
    num_bad,  # bad pages in [start, end): > 0 re-checks every token's page
    qk_scale,
    D,
    DV,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_etb,
    PAGE_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    CAUSAL: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """Online softmax of the rows over sequence b's tokens [start, end): (max, sum, unnormalised acc),
    log2 domain. A token of a page with the wrong tag gets a -inf score and a zero V row."""
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_DV), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # [BN] token positions
        n_ok = n < end
        page_idx = n // PAGE_SIZE
        page = tl.load(page_table_ptr + b * stride_ptb + page_idx, mask=n_ok, other=0)
        tok_ok = n_ok
        if CHECK_TAGS:  # noqa: SIM102 (a constexpr test, then a run-time one)
            if num_bad > 0:  # only in a slice of a sequence that is about to be aborted
                found_n = tl.load(page_tags_ptr + page, mask=n_ok, other=0)
                expected_n = tl.load(expected_ptr + b * stride_etb + page_idx, mask=n_ok, other=0)
                tok_ok = n_ok & (found_n == expected_n)
        # a failed page is dropped by the masks below (scores to -inf, V rows to zero, NaN included)
        slot = page.to(tl.int64) * stride_kp + (n % PAGE_SIZE) * stride_ks + kvh * stride_kh
        k = tl.load(k_ptr + slot[:, None] + offs_d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=DOT_PRECISION) * qk_scale  # [ROWS, BN]
        seen = tok_ok[None, :]
        if CAUSAL:
            seen = seen & (n[None, :] < row_limit[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        alpha = tl.exp2(m - m_base)
        p = tl.exp2(s - m_base[:, None])  # [ROWS, BN]
        l = l * alpha + tl.sum(p, axis=1)
        vslot = page.to(tl.int64) * stride_vp + (n % PAGE_SIZE) * stride_vs + kvh * stride_vh
        v = tl.load(v_ptr + vslot[:, None] + offs_dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        v = tl.where(tok_ok[:, None], v.to(COMPUTE), 0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc


@triton.jit
def paged_decode_gqa_v3_kernel(
    q_ptr,  # [B, Hq, D]
    k_ptr,  # [P, S, Hkv, D]
    v_ptr,  # [P, S, Hkv, Dv]
    page_table_ptr,  # [B, Mp] int32
    expected_ptr,  # [B, Mp] int64
    page_tags_ptr,  # [P] int64
    seq_lens_ptr,  # [B] int32
    mismatch_ptr,  # [B] uint8 (the bool flags, viewed)
    part_o_ptr,  # [B, Hq, NS, Dv] fp32
    part_lse_ptr,  # [B, Hq, NS] fp32, log2 domain
    qk_scale,  # softmax_scale * k_scale * log2(e)
    num_splits,
    D,
    DV,
    stride_qb,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_etb,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 caches (e4m3 -> fp16 is one cvt), else q's
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(seq_lens_ptr + b)
    per_split = tl.cdiv(tl.cdiv(L, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, L)
    offs_h = tl.arange(0, BLOCK_H)
    h_ok = offs_h < GROUP
    heads = kvh * GROUP + offs_h  # [BH] query heads of this KV head
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
        mask=h_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(COMPUTE)  # [BH, D]
    num_bad = 0
    if CHECK_TAGS:
        num_bad = count_bad_pages(
            page_table_ptr,
            expected_ptr,
            page_tags_ptr,
            b,
            stride_ptb,
            stride_etb,
            start,
            end,
            PAGE_SIZE,
            BLOCK_P,
        )
        tl.store(mismatch_ptr + b, 1, mask=num_bad > 0)
    m, l, acc = attend_slice_v3(
        q, 0, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end, num_bad, qk_scale,
        D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, CHECK_TAGS, False, COMPUTE, DOT_PRECISION,
    )  # fmt: skip
    lse = tl.where(l > 0.0, m + tl.log2(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BH] index into [B, Hq, NS]
    tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], o, mask=h_ok[:, None] & dv_ok[None, :])
    tl.store(part_lse_ptr + row, lse, mask=h_ok)


@triton.jit
def paged_prefill_gqa_v3_kernel(
    q_ptr,  # [T, Hq, D]
    k_ptr,  # [P, S, Hkv, D]
    v_ptr,  # [P, S, Hkv, Dv]
    page_table_ptr,  # [B, Mp] int32
    expected_ptr,  # [B, Mp] int64
    page_tags_ptr,  # [P] int64
    seq_lens_ptr,  # [B] int32
    query_start_ptr,  # [B+1] int32
    tile_seq_ptr,  # [NT] int32 sequence of each tile, >= B = idle
    tile_q0_ptr,  # [NT] int32 first query row of each tile
    mismatch_ptr,  # [B] uint8 (the bool flags, viewed)
    part_o_ptr,  # [T, Hq, NS, Dv] fp32 (unused when DIRECT)
    part_lse_ptr,  # [T, Hq, NS] fp32, log2 domain (unused when DIRECT)
    out_ptr,  # [T, Hq, Dv] q's dtype (DIRECT only)
    qk_scale,  # softmax_scale * k_scale * log2(e)
    v_scale,  # DIRECT only
    num_seqs,
    num_splits,
    num_q_heads,
    D,
    DV,
    stride_qt,
    stride_qh,
    stride_kp,
    stride_ks,
    stride_kh,
    stride_vp,
    stride_vs,
    stride_vh,
    stride_ptb,
    stride_etb,
    stride_ot,
    stride_oh,
    PAGE_SIZE: tl.constexpr,
    GROUP: tl.constexpr,  # query heads per KV head
    BLOCK_Q: tl.constexpr,  # queries per tile = BLOCK_M // GROUP
    BLOCK_M: tl.constexpr,  # rows = (query, head) pairs, a power of two >= BLOCK_Q * GROUP
    BLOCK_N: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    DIRECT: tl.constexpr,  # one slice: write the final output, skip the partials
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 caches, else q's
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b, tile_ok, q0, num_q, L, first_pos, _ = query_tile(
        tile_seq_ptr, tile_q0_ptr, query_start_ptr, seq_lens_ptr, tile, num_seqs, BLOCK_Q
    )
    num_items = tl.where(tile_ok, first_pos + num_q, 0)  # tokens the tile's last query sees
    per_split = tl.cdiv(tl.cdiv(num_items, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, num_items)

    rows = tl.arange(0, BLOCK_M)
    qi = rows // GROUP  # [BM] query of the row within the tile
    heads = kvh * GROUP + rows % GROUP  # [BM] query head
    row_ok = qi < num_q
    t_row = (q0 + qi).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = tl.load(
        q_ptr + t_row[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & (offs_d < D)[None, :],
        other=0.0,
    ).to(COMPUTE)  # [BM, D]
    num_bad = 0
    if CHECK_TAGS:  # the slice's pages at once; the slice's tokens are re-checked only if one is bad
        num_bad = count_bad_pages(
            page_table_ptr,
            expected_ptr,
            page_tags_ptr,
            b,
            stride_ptb,
            stride_etb,
            start,
            end,
            PAGE_SIZE,
            BLOCK_P,
        )
        tl.store(mismatch_ptr + b, 1, mask=num_bad > 0)
    row_limit = first_pos + qi + 1  # [BM] tokens the row's query may see (causal)
    m, l, acc = attend_slice_v3(
        q, row_limit, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end, num_bad,
        qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, CHECK_TAGS, True, COMPUTE, DOT_PRECISION,
    )  # fmt: skip

    l_safe = tl.where(l > 0.0, l, 1.0)
    o_mask = row_ok[:, None] & (offs_dv < DV)[None, :]
    if DIRECT:
        out = out_ptr + t_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_dv[None, :]
        tl.store(out, (acc / l_safe[:, None] * v_scale).to(out_ptr.dtype.element_ty), mask=o_mask)
    else:
        lse = tl.where(l > 0.0, m + tl.log2(l_safe), float("-inf"))
        part_row = (t_row * num_q_heads + heads) * num_splits + split  # [BM] index into [T, Hq, NS]
        tl.store(part_o_ptr + part_row[:, None] * DV + offs_dv[None, :], acc / l_safe[:, None], mask=o_mask)
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)


@triton.jit
def dsa_scores_v3_kernel(
    q_ptr,  # [T, Hi, Di]
    w_ptr,  # [T, Hi] fp32
    k_ptr,  # [P, S, Di]
    page_table_ptr,  # [B, Mp] int32
    expected_ptr,  # [B, Mp] int64
    page_tags_ptr,  # [P] int64
    seq_lens_ptr,  # [B] int32
    query_start_ptr,  # [B+1] int32
    tile_seq_ptr,  # [NT] int32 sequence of each tile, >= B = idle
    tile_q0_ptr,  # [NT] int32 first query row of each tile
    mismatch_ptr,  # [B] uint8 (the bool flags, viewed)
    scores_ptr,  # [NTc * BLOCK_Q, W] fp32, row (tile - tile_base) * BLOCK_Q + query of the tile
    qk_scale,  # softmax_scale * k_scale
    tile_base,  # first tile of this launch
    num_seqs,
    num_heads,
    DI,
    W,
    stride_qt,
    stride_qh,
    stride_wt,
    stride_kp,
    stride_ks,
    stride_ptb,
    stride_etb,
    stride_st,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # queries per tile
    BLOCK_H: tl.constexpr,  # heads per query, a power of two >= Hi; rows of the dot = BLOCK_Q * BLOCK_H
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 keys, else q's
    DOT_PRECISION: tl.constexpr,
):
    nb = tl.program_id(0)
    local = tl.program_id(1)
    tile = tile_base + local
    b, tile_ok, q0, num_q, L, first_pos, _ = query_tile(
        tile_seq_ptr, tile_q0_ptr, query_start_ptr, seq_lens_ptr, tile, num_seqs, BLOCK_Q
    )
    num_items = tl.where(tile_ok, first_pos + num_q, 0)  # tokens the tile's last query sees

    n = nb * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] token positions
    qr = tl.arange(0, BLOCK_Q)  # [BQ] query of the tile
    sc = tl.full((BLOCK_Q, BLOCK_N), float("-inf"), dtype=tl.float32)
    if nb * BLOCK_N < num_items:
        n_ok = n < num_items
        page_idx = n // PAGE_SIZE
        page = tl.load(page_table_ptr + b * stride_ptb + page_idx, mask=n_ok, other=0)
        tok_ok = n_ok
        if CHECK_TAGS:
            found = tl.load(page_tags_ptr + page, mask=n_ok, other=0)
            expected = tl.load(expected_ptr + b * stride_etb + page_idx, mask=n_ok, other=0)
            tok_ok = n_ok & (found == expected)
            tl.store(mismatch_ptr + b, 1, mask=tl.sum((n_ok & (found != expected)).to(tl.int32)) > 0)
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        qi = rows // BLOCK_H
        h = rows % BLOCK_H
        row_ok = (qi < num_q) & (h < num_heads)
        t_row = (q0 + qi).to(tl.int64)
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < DI
        q = tl.load(
            q_ptr + t_row[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        ).to(COMPUTE)  # [BM, Di]
        w = tl.load(w_ptr + t_row * stride_wt + h, mask=row_ok, other=0.0)  # [BM]
        slot = page.to(tl.int64) * stride_kp + (n % PAGE_SIZE).to(tl.int64) * stride_ks
        k = tl.load(k_ptr + slot[:, None] + offs_d[None, :], mask=tok_ok[:, None] & d_ok[None, :], other=0.0)
        if BLOCK_Q == 1:  # decode: tokens as the dot's rows (32 head rows spill registers on sm90)
            st = tl.dot(k.to(COMPUTE), tl.trans(q), input_precision=DOT_PRECISION)  # [BN, BM]
            st = tl.maximum(st * qk_scale, 0.0) * w[None, :]
            per_query = tl.sum(st, axis=1)[None, :]  # [1, BN]
        else:
            s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=DOT_PRECISION)  # [BM, BN]
            s = tl.maximum(s * qk_scale, 0.0) * w[:, None]
            per_query = tl.sum(tl.reshape(s, (BLOCK_Q, BLOCK_H, BLOCK_N)), axis=1)  # [BQ, BN]
        limit = first_pos + qr + 1  # [BQ] causal
        seen = tok_ok[None, :] & (n[None, :] < limit[:, None]) & (qr < num_q)[:, None]
        sc = tl.where(seen, per_query, float("-inf"))
    out_row = (local * BLOCK_Q + qr).to(tl.int64)
    tl.store(scores_ptr + out_row[:, None] * stride_st + n[None, :], sc, mask=(n < W)[None, :])

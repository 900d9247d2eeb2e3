"""Paged decode attention for GQA (one new token per sequence), BF16 or FP8 e4m3 KV, tag-checked.

Split-K: stage 1 (`_paged_decode_gqa_kernel`, grid `(B, Hkv, splits)`) walks one slice of one
sequence's tokens for one KV head and all `G = Hq / Hkv` query heads that share it (one K/V load,
`tl.dot` over G rows), with an online softmax; it writes the normalised partial output and its
log-sum-exp. Stage 2 (`kernels.split_k_merge`, grid `(B, Hq)`) merges the slices by LSE. The number of
slices is chosen from batch, KV heads and the page table's width (host-known, so the launch can be
captured in a CUDA graph), never from a device read.

The page-tag check is fused into stage 1: each token's page tag is compared with the sequence's
expected tag for that page; tokens of a mismatched page are masked out of the scores and their V
rows replaced by zeros (another tenant's FP8 bytes may even be NaN), and `tag_mismatch[b]` is set
so the engine aborts the sequence. Each program first checks all pages of its slice in one vectorised
pass (independent loads, BLOCK_P pages at a time); only a slice that holds a bad page re-checks per
token inside the main loop. (Per-token checks in the main loop measured +25-35% on the H200.) With
an FP8 cache the dots run in fp16 (e4m3 -> fp16 is a single unpack instruction). FP8 scales are per layer: `k_scale` folds into the softmax scale, `v_scale` into the
merge.

Shapes: B sequences, Hq query heads, Hkv KV heads, D head dim, Dv value dim, P pages, S page size,
Mp pages per sequence in the table.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.split_k_merge import TL_DTYPES, merge_splits, num_sms


@triton.jit
def count_bad_pages(
    page_table_ptr,  # [B, Mp] int32
    expected_ptr,  # [B, Mp] int64
    page_tags_ptr,  # [P] int64
    b,
    stride_ptb,
    stride_etb,
    start,
    end,
    PAGE_SIZE: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Pages of sequence b's tokens [start, end) whose tag is wrong: BLOCK_P independent loads at a time."""
    num_bad = 0
    for p0 in range(start // PAGE_SIZE, tl.cdiv(end, PAGE_SIZE), BLOCK_P):
        pi = p0 + tl.arange(0, BLOCK_P)
        p_ok = pi < tl.cdiv(end, PAGE_SIZE)
        pg = tl.load(page_table_ptr + b * stride_ptb + pi, mask=p_ok, other=0)
        found = tl.load(page_tags_ptr + pg, mask=p_ok, other=0)
        expected = tl.load(expected_ptr + b * stride_etb + pi, mask=p_ok, other=0)
        num_bad += tl.sum((p_ok & (found != expected)).to(tl.int32))
    return num_bad


@triton.jit
def attend_slice(
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
def _paged_decode_gqa_kernel(
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
    m, l, acc = attend_slice(
        q, 0, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end, num_bad, qk_scale,
        D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, BLOCK_H, BLOCK_N, BLOCK_D, BLOCK_DV, CHECK_TAGS, False, COMPUTE, DOT_PRECISION,
    )  # fmt: skip
    lse = tl.where(l > 0.0, m + tl.log2(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BH] index into [B, Hq, NS]
    tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], o, mask=h_ok[:, None] & dv_ok[None, :])
    tl.store(part_lse_ptr + row, lse, mask=h_ok)


def pick_num_splits(batch: int, num_kv_heads: int, max_tokens: int, num_sms: int) -> int:
    """Slices per sequence: about four programs per SM, each slice at least 256 tokens, at most 64."""
    want = triton.cdiv(4 * num_sms, max(batch * num_kv_heads, 1))
    return max(1, min(want, triton.cdiv(max_tokens, 256), 64))


def check_gqa_inputs(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [P, S, Hkv, D]
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    tag_mismatch: torch.Tensor,
) -> None:
    """Shapes, dtypes and strides both GQA launchers (decode and prefill) need; raises on the first misfit."""
    _, Hq, D = q.shape
    P, S, Hkv, Dk = k_cache.shape
    B = seq_lens.shape[0]
    if Dk != D or v_cache.shape[:3] != (P, S, Hkv) or Hq % Hkv:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)} do not fit")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if k_cache.dtype != v_cache.dtype or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(f"KV cache must be {q.dtype} or float8_e4m3fn, got {k_cache.dtype}/{v_cache.dtype}")
    if seq_lens.dim() != 1 or page_table.shape[0] != B or expected_tags.shape != page_table.shape:
        raise ValueError("seq_lens [B], page_table [B, Mp] and expected_tags [B, Mp] must agree")
    if tag_mismatch.shape != (B,) or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")
    if page_table.stride(1) != 1 or expected_tags.stride(1) != 1:
        raise ValueError("page_table and expected_tags rows must be contiguous")


def paged_decode_gqa(
    q: torch.Tensor,  # [B, Hq, D] fp16 / bf16 / fp32
    k_cache: torch.Tensor,  # [P, S, Hkv, D] q's dtype or float8_e4m3fn
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    k_scale: float,
    v_scale: float,
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache including the new one
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, set (never cleared) where a page's tag is wrong
    softmax_scale: float,
    num_splits: int | None = None,
    check_tags: bool = True,  # False only to measure the check's cost
    block_n: int | None = None,  # tokens per step: 128 for FP8, 32 for 16-bit caches (measured best)
) -> torch.Tensor:  # [B, Hq, Dv] in q's dtype
    """Attention of each sequence's one new query over its paged K/V; see the module docstring."""
    B, Hq, D = q.shape
    if seq_lens.shape != (B,):
        raise ValueError(
            f"decode takes one query per sequence: q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )
    check_gqa_inputs(q, k_cache, v_cache, seq_lens, page_table, expected_tags, tag_mismatch)
    _, S, Hkv, _ = k_cache.shape
    Dv = v_cache.shape[3]
    out = torch.empty((B, Hq, Dv), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    G = Hq // Hkv
    if block_n is None:
        block_n = 128 if k_cache.dtype == torch.float8_e4m3fn else 32
    splits = num_splits or pick_num_splits(B, Hkv, page_table.shape[1] * S, num_sms(q.device))
    part_o = torch.empty((B, Hq, splits, Dv), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    _paged_decode_gqa_kernel[(B, Hkv, splits)](
        q,
        k_cache,
        v_cache,
        page_table,
        expected_tags,
        page_tags,
        seq_lens,
        tag_mismatch.view(torch.uint8),
        part_o,
        part_lse,
        softmax_scale * k_scale * math.log2(math.e),
        splits,
        D,
        Dv,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        page_table.stride(0),
        expected_tags.stride(0),
        PAGE_SIZE=S,
        GROUP=G,
        BLOCK_H=max(16, triton.next_power_of_2(G)),
        BLOCK_N=block_n,
        BLOCK_P=64,
        BLOCK_D=triton.next_power_of_2(D),
        BLOCK_DV=triton.next_power_of_2(Dv),
        CHECK_TAGS=check_tags,
        COMPUTE=tl.float16 if k_cache.dtype == torch.float8_e4m3fn else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4,
        num_stages=2,
    )
    merge_splits(part_o, part_lse, out, v_scale)
    return out


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
    from kernels.paged_attention import paged_attention_ref

    query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return paged_attention_ref(
        q, k_cache, v_cache, k_scale, v_scale, query_start, seq_lens, page_table,
        expected_tags, page_tags, tag_mismatch, softmax_scale,
    )  # fmt: skip

"""One program's share of GQA attention over the paged cache: rows × one slice of a sequence's tokens.

Both GQA kernels (`paged_decode_gqa`, `paged_prefill_gqa`) run `attend_slice`: an online softmax
(log2 domain) of ROWS query rows that share KV head `kvh` over sequence b's tokens [start, end),
BLOCK_N tokens a step, each K/V tile loaded once for all rows and used by two `tl.dot`s.

Page-tag check, kept out of the hot loop: the slice is first walked with no tag read at all (its loop
compiles to the same SASS as with `CHECK_TAGS=False`); then its pages are checked in one vectorised
pass (`count_bad_pages`, BLOCK_P independent loads at a time; the page table is in L2 by then). Only
a slice that holds a bad page — its sequence is about to be aborted — sets `tag_mismatch[b]` and is
walked again with per-token checks: a token of a bad page gets a -inf score and its K/V rows are
never read (the load masks drop them: the bytes may be another tenant's NaN); the first walk's
result is discarded. The re-walk must start from a fresh state and cover exactly the slice's
tokens (issue 27: the first walk read a bad page before its check); the tests
`test_rewalk_covers_every_page_the_hot_walk_read` (decode) and
`test_second_launch_covers_every_page_the_first_read` (prefill) pin that. (The 2026-11-29 kernels
this replaced checked first, with a run-time branch in the loop: +6-7% on the H200.)

What the sm90 SASS showed, per tile (`python -m tests.kernels.sm90_compile_gqa --all --sass`):
- offsets: a page's 64-bit base once per token, the in-page part in 32 bits, shared by K and V when
  their strides agree (SHARED_OFFSETS); where BLOCK_N is a multiple of the page size, tiles start on a
  page boundary, so each lane's page index and slot are loop invariants (no per-tile division);
- whole tiles (all but a slice's last, and below the causal diagonal) carry no token masks and no
  select (MASKED is off), and no column masks when D and Dv are powers of two (EVEN_D);
- the softmax scale folds into one FFMA a score (`s · c - m`), the max taken on unscaled scores;
- SPLIT_V (FP8): V is read as uint16 byte pairs, which Triton transposes for the PV dot as 16-bit
  values (ldmatrix.trans); one byte permute and one convert per two values (`e4m3_pairs_to_fp16`)
  split them into the even and the odd columns, two dots of Dv / 2. Triton's own lowering read FP8 V
  from shared memory byte by byte (128 LDS.U8 a thread per 128 tokens), or through a select and a
  16-bit copy;
- LAZY_SUM: the softmax denominator kept per (row, token lane) and summed once at the end, so a tile
  needs one cross-warp reduction (the max), not two (fewer barriers; more registers for FP8).

Shapes: ROWS query rows, D head dim, Dv value dim, P pages, S page size, Mp pages per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl


@dataclass(frozen=True, slots=True)
class GQATiles:
    """One launch configuration of a GQA kernel (an entry of a launcher's tile table)."""

    block_n: int  # tokens per step
    num_warps: int = 4
    num_stages: int = 2
    block_m: int = 128  # prefill: rows (query, head) per tile; decode uses the group size
    lazy_sum: bool = False
    split_v: bool = False  # FP8 caches only
    programs_per_sm: int | None = None  # resident at once (registers, shared memory); None: ~4 a SM
    max_registers: int | None = None  # a cap (maxnreg) where the cold paths would set a higher count


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
def e4m3_pairs_to_fp16(w, ASM: tl.constexpr):
    """uint16 words of two e4m3 bytes → (low bytes, high bytes) as fp16, each w's shape.

    ASM: one byte permute and one convert per two values, where Triton's own lowering of the same
    shifts and casts takes four more instructions; the interpreter (no PTX) takes the casts."""
    if ASM:
        lo = tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 u; prmt.b32 t, $1, 0, 0x0020; cvt.u16.u32 u, t; cvt.rn.f16x2.e4m3x2 $0, u; }",
            "=r,r", [w], dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
        hi = tl.inline_asm_elementwise(
            "{ .reg .b32 t; .reg .b16 u; prmt.b32 t, $1, 0, 0x0031; cvt.u16.u32 u, t; cvt.rn.f16x2.e4m3x2 $0, u; }",
            "=r,r", [w], dtype=tl.float16, is_pure=True, pack=2,
        )  # fmt: skip
    else:
        lo = (w & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
        hi = (w >> 8).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float16)
    return lo, hi


@triton.jit
def load_tile(ptrs, rows_ok, cols_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """A [rows, cols] tile load with only the masks it needs; masked elements read as 0."""
    if MASK_ROWS:
        mask = rows_ok[:, None]
        if MASK_COLS:
            mask = rows_ok[:, None] & cols_ok[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0)
    elif MASK_COLS:
        x = tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    else:
        x = tl.load(ptrs)
    return x


@triton.jit
def attend_tiles(
    m,  # [ROWS] running max (log2 domain)
    l,  # [ROWS] running sum, or [ROWS, BLOCK_N] per token lane (LAZY_SUM)
    acc,  # [ROWS, BLOCK_DV] fp32 unnormalised output; SPLIT_V: its even columns [ROWS, BLOCK_DV // 2]
    acc2,  # SPLIT_V: the odd columns [ROWS, BLOCK_DV // 2] (else not touched)
    q,  # [ROWS, BLOCK_D] COMPUTE
    row_limit,  # [ROWS] tokens each row may see (CAUSAL_MASK only)
    k_ptr,  # [P, S, Hkv, D]
    v_ptr,  # [P, S, Hkv, Dv]
    page_table_ptr,
    expected_ptr,
    page_tags_ptr,
    b,
    kvh,
    lo,  # first token, a multiple of BLOCK_N
    hi,
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
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    MASKED: tl.constexpr,  # the tokens past `hi`, CHECKED's and CAUSAL_MASK's are masked (else whole tiles)
    CHECKED: tl.constexpr,  # compare each token's page tag (the re-walk of a slice with a bad page)
    CAUSAL_MASK: tl.constexpr,
    EVEN_D: tl.constexpr,  # D == BLOCK_D and DV == BLOCK_DV: no column masks
    SHARED_OFFSETS: tl.constexpr,
    SPLIT_V: tl.constexpr,
    LAZY_SUM: tl.constexpr,
    ASM: tl.constexpr,
    COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The online softmax over tokens [lo, hi), BLOCK_N a step; returns the updated (m, l, acc, acc2)."""
    j = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    offs_c = tl.arange(0, BLOCK_DV // 2)
    d_ok = offs_d < D
    dv_ok = offs_dv < DV
    c_ok = offs_c < DV // 2
    for n0 in range(lo, hi, BLOCK_N):
        n = n0 + j  # [BN] token positions
        n_ok = n < hi  # used by MASKED tiles only
        if BLOCK_N % PAGE_SIZE == 0:  # n0 starts a page: lane j's page and slot do not change
            page_idx = n0 // PAGE_SIZE + j // PAGE_SIZE
            slot = j % PAGE_SIZE
        else:
            page_idx = n // PAGE_SIZE
            slot = n % PAGE_SIZE
        if MASKED:
            page = tl.load(page_table_ptr + b * stride_ptb + page_idx, mask=n_ok, other=0).to(tl.int64)
        else:
            page = tl.load(page_table_ptr + b * stride_ptb + page_idx).to(tl.int64)
        ok = n_ok
        if CHECKED:
            found = tl.load(page_tags_ptr + page, mask=n_ok, other=0)
            expected = tl.load(expected_ptr + b * stride_etb + page_idx, mask=n_ok, other=0)
            ok = n_ok & (found == expected)
        k_off = page * stride_kp + (slot * stride_ks + kvh * stride_kh)  # [BN] int64
        v_off = k_off
        if not SHARED_OFFSETS:
            v_off = page * stride_vp + (slot * stride_vs + kvh * stride_vh)
        k = load_tile(k_ptr + k_off[:, None] + offs_d[None, :], ok, d_ok, MASKED, not EVEN_D)
        s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=DOT_PRECISION)  # [ROWS, BN] unscaled
        if MASKED:
            seen = ok[None, :]
            if CAUSAL_MASK:
                seen = seen & (n[None, :] < row_limit[:, None])
            s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1) * qk_scale)  # qk_scale > 0: the max commutes with it
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        alpha = tl.exp2(m - m_base)
        p = tl.exp2(s * qk_scale - m_base[:, None])  # [ROWS, BN]: one FFMA a score
        l = l * alpha[:, None] + p if LAZY_SUM else l * alpha + tl.sum(p, axis=1)
        if SPLIT_V:  # byte pairs: Triton transposes them as 16-bit values, two dots take the halves
            pairs = v_ptr.to(tl.pointer_type(tl.uint16)) + (v_off >> 1)[:, None] + offs_c[None, :]
            v_lo, v_hi = e4m3_pairs_to_fp16(load_tile(pairs, ok, c_ok, MASKED, not EVEN_D), ASM)
            pc = p.to(COMPUTE)
            acc = acc * alpha[:, None] + tl.dot(pc, v_lo, input_precision=DOT_PRECISION)
            acc2 = acc2 * alpha[:, None] + tl.dot(pc, v_hi, input_precision=DOT_PRECISION)
        else:
            v = load_tile(v_ptr + v_off[:, None] + offs_dv[None, :], ok, dv_ok, MASKED, not EVEN_D)
            acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v.to(COMPUTE), input_precision=DOT_PRECISION)
        m = m_new
    return m, l, acc, acc2


@triton.jit
def attend_range(
    q, row_limit, full_end, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end,
    qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
    PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CHECKED: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr,
    SHARED_OFFSETS: tl.constexpr, SPLIT_V: tl.constexpr, LAZY_SUM: tl.constexpr, ASM: tl.constexpr,
    COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """(m, l [ROWS], acc, acc2) over [start, end) from a fresh state: whole tiles unmasked, then the masked
    rest (the slice's last tile; CAUSAL: from `full_end`, the first token some row may not see, on) in
    tiles of at most 32 tokens, so that their masks do not set the kernel's register count."""
    m = tl.full((ROWS,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((ROWS, BLOCK_N) if LAZY_SUM else (ROWS,), dtype=tl.float32)
    acc = tl.zeros((ROWS, BLOCK_DV // 2) if SPLIT_V else (ROWS, BLOCK_DV), dtype=tl.float32)
    acc2 = tl.zeros((ROWS, BLOCK_DV // 2) if SPLIT_V else (1, 1), dtype=tl.float32)
    if CAUSAL:
        mid = tl.maximum(start, tl.minimum(end, full_end // BLOCK_N * BLOCK_N))
    else:
        mid = tl.maximum(start, start + (end - start) // BLOCK_N * BLOCK_N)
    m, l, acc, acc2 = attend_tiles(
        m, l, acc, acc2, q, row_limit, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start,
        mid, qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb,
        stride_etb, PAGE_SIZE, BLOCK_N, BLOCK_D, BLOCK_DV, CHECKED, CHECKED, False, EVEN_D, SHARED_OFFSETS,
        SPLIT_V, LAZY_SUM, ASM, COMPUTE, DOT_PRECISION,
    )  # fmt: skip
    if LAZY_SUM:
        l = tl.sum(l, axis=1)
    m, l, acc, acc2 = attend_tiles(
        m, l, acc, acc2, q, row_limit, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, mid, end,
        qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, max(16, min(BLOCK_N // 2, 32)), BLOCK_D, BLOCK_DV, True, CHECKED, CAUSAL, EVEN_D, SHARED_OFFSETS,
        SPLIT_V, False, ASM, COMPUTE, DOT_PRECISION,
    )  # fmt: skip
    return m, l, acc, acc2


@triton.jit
def attend_slice(
    q, row_limit, full_end, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, mismatch_ptr, b, kvh,
    start, end, qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb,
    stride_etb, PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, CHECK_TAGS: tl.constexpr, CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr, SHARED_OFFSETS: tl.constexpr, SPLIT_V: tl.constexpr, LAZY_SUM: tl.constexpr,
    ASM: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """(m, l [ROWS], acc [ROWS, BLOCK_DV]) of the rows over sequence b's tokens [start, end),
    tag-checked as the module docstring says."""
    m, l, acc, acc2 = attend_range(
        q, row_limit, full_end, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end,
        qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, ROWS, BLOCK_N, BLOCK_D, BLOCK_DV, False, CAUSAL, EVEN_D, SHARED_OFFSETS, SPLIT_V, LAZY_SUM,
        ASM, COMPUTE, DOT_PRECISION,
    )  # fmt: skip
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
        if num_bad > 0:  # only in a slice of a sequence that is about to be aborted
            tl.store(mismatch_ptr + b, 1)
            # one thread stored the flag: every warp must read back 1, or warps start the re-walk at different
            # tokens and disagree on its trip count around the tile barriers (a hang, or wgmma garbage)
            tl.debug_barrier()
            # `start` again, through a value the compiler cannot know (the flag just stored, 1): the re-walk's
            # first tile is not merged with the first walk's, whose masks would stay live through the hot loop
            restart = start * tl.load(mismatch_ptr + b, volatile=True).to(tl.int32)
            m, l, acc, acc2 = attend_checked(
                q, row_limit, full_end, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, restart,
                end, qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                stride_ptb, stride_etb, PAGE_SIZE, ROWS, BLOCK_N, BLOCK_D, BLOCK_DV, CAUSAL, EVEN_D,
                SHARED_OFFSETS, SPLIT_V, LAZY_SUM, ASM, COMPUTE, DOT_PRECISION,
            )  # fmt: skip
    return m, l, join_halves(acc, acc2, ROWS, BLOCK_DV, SPLIT_V)


@triton.jit
def attend_checked(
    q, row_limit, full_end, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end,
    qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
    PAGE_SIZE: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, CAUSAL: tl.constexpr, EVEN_D: tl.constexpr, SHARED_OFFSETS: tl.constexpr,
    SPLIT_V: tl.constexpr, LAZY_SUM: tl.constexpr, ASM: tl.constexpr, COMPUTE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """`attend_range` with per-token tag checks, the walk of a slice that holds a bad page, in half tiles
    of at most 32 tokens: this cold walk, not the hot loop, would otherwise set the kernel's register
    count (FP8, 128-token tiles: 154 registers, 3 programs per SM, instead of 4)."""
    return attend_range(
        q, row_limit, full_end, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh, start, end,
        qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, ROWS, max(16, min(BLOCK_N // 2, 32)), BLOCK_D, BLOCK_DV, True, CAUSAL, EVEN_D, SHARED_OFFSETS,
        SPLIT_V, LAZY_SUM, ASM, COMPUTE, DOT_PRECISION,
    )  # fmt: skip


@triton.jit
def join_halves(acc, acc2, ROWS: tl.constexpr, BLOCK_DV: tl.constexpr, SPLIT_V: tl.constexpr):
    """SPLIT_V: the even and the odd value columns back together as [ROWS, BLOCK_DV]; else `acc`."""
    if SPLIT_V:
        acc = tl.reshape(tl.join(acc, acc2), (ROWS, BLOCK_DV))
    return acc


def slice_constexprs(
    tiles: GQATiles,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_d: int,
    block_dv: int,
) -> dict[str, Any]:
    """The constexprs a kernel passes `attend_slice` beyond its tiles.
    SPLIT_V needs an FP8 cache whose rows and offsets are whole byte pairs, and two dots of >= 64 columns:
    on the H200 the prefill kernel's even columns came out wrong in some tiles with 16-column halves
    (Dv = 32, 2026-12-02, also an illegal address at 128-token tiles) and with 32-column halves (Dv = 64,
    2026-12-02 second run: rel. err 0.2-0.5 for v4 and v4-n128, `lab/results/2026-12-02-gqa-prefill-splitv-diag-run2.log`);
    Dv = 128 (GLM-4.5) matched in every sweep and GPU test. Below that, V is read byte by byte."""
    pairs = (
        v_cache.dtype == torch.float8_e4m3fn
        and block_dv >= 128
        and all(s % 2 == 0 for s in v_cache.stride()[:3])
        and v_cache.data_ptr() % 2 == 0  # a view at an odd byte offset would fault on the 2-byte loads
    )
    return {
        "EVEN_D": block_d == k_cache.shape[3] and block_dv == v_cache.shape[3],
        "SHARED_OFFSETS": k_cache.stride() == v_cache.stride(),
        "SPLIT_V": tiles.split_v and pairs,
        "LAZY_SUM": tiles.lazy_sum,
        "ASM": q.is_cuda,  # the interpreter runs no PTX
        "BLOCK_P": 1024,
    }

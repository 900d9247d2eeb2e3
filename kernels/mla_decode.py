"""Paged MLA decode attention (one new token per sequence), BF16 or FP8 e4m3 latent cache, tag-checked.

The cache holds one `[R + Dr]` line per token (576 for Kimi K2 / GLM-5: latent `c` then rotated
`k_pe`); queries come absorbed (`[q_nope · W_UK | q_pe]`), so this is MQA with one shared "head":
the key is the whole line, the value its first R dims (engine-anchors §1d, §2c).

Split-K: stage 1 (`_mla_paged_kernel`, grid `(H / BLOCK_H, splits, B)`) walks one slice of one
sequence for a tile of BLOCK_H heads, BLOCK_N tokens a step, with an online softmax, and writes the
normalised partial output and its log-sum-exp (log2 domain); stage 2 (`kernels.split_k_merge`) merges
the slices (one slice: stage 1 writes the output). The same kernel serves prefill
(`kernels/mla_prefill.py`: VARLEN, BLOCK_Q queries × BLOCK_H heads a tile, causal per row). Tiles and
the slice count come from `kernels/mla_tiles.py`, chosen on the host from the shapes only (no device
read: the launch can be captured in a CUDA graph).

How a step runs, and why (the first version spent ~5 µs a 16-token step waiting on loads one after
another: page ids, then tags, then lines, each a synchronous load on the H200):
- Every load of the token loop is a page id (sparse: a position, then an id) or a line, so Triton's
  pipeliner turns them all into cp.async copies, `num_stages - 1` steps ahead split over the chain.
- A 64-row tile (64 heads) runs wgmma over two warpgroups: each latent tile is read once from shared
  memory by the score dots (`q · [c | k_pe]^T`) and the value dot (`p · c`), the fp32 accumulator
  [64, 512] holds 128 registers a thread. Under 64 rows mma.sync holds whole operands in registers,
  so the latent goes in NUM_RC chunks (64 columns by default: then the latent and rope chunks share
  one layout and the page ids are fetched in one, not one per chunk width).
- FP8 lines are converted once to fp16 (`e4m3_to_f16`, or with `MlaTiles.fp8_shift` by moving bits,
  `e4m3_to_f16_shifted`, whose 2^-8 joins the scales) and stored for both dots; the layer's single
  scale folds into the softmax scale and the output. q is cast to fp16 (|q| > 65504 would overflow).
  At 64 heads that is 242 FLOP per FP8 byte: tensor cores, not HBM, bound it; 8 or 16 heads are
  HBM-bound.
- Why FP8 was slower than BF16 (sm90 SASS of the 16-row tiles, 2026-12-04): both kernels spend
  ~75-86 SM cycles a token (0.59 / 0.69 ms for 2.1M tokens on 132 SMs); BF16 needs 72 to match HBM,
  FP8 would need 36. Per token FP8 issues 78 warp instructions against BF16's 56 (9 conversions, the
  lines' round trip cp.async -> registers -> fp16 in shared memory, 10 barriers a 32-token step
  against 9 a 64-token one), at two CTAs of 4 warps an SM: the step is latency-bound, and halving
  the bytes did not halve it. 8 heads run the 16-row tile (tl.dot's least), so they cost what 16 do.
- `MlaTiles.swap` computes the transposed products (`attend_slice`): tokens are the MMA's rows, so a
  64-token step runs wgmma whatever the head count; the candidates are timed by
  `lab/diagnostics/mla_ab.py` against the committed configuration.
- `MlaTiles.fp8_dot` (issue 24; other numerics, so no default before `kumo eval`'s gate): the lines
  feed e4m3 dots as they are, q rounded to e4m3 per (token, head) row (`e4m3_rows`, its scale in the
  scores), the weights as codes of p * 448 with their sum taken over the rounded codes (`attend_slice`).
  Triton 3.6 on sm90 runs an 8-bit dot under 64 rows as fp16 mma.sync, so 8-32 heads need the swapped
  products; and fp8 wgmma takes K-major operands only, so the value dot's tile (tokens x latent,
  latent-major in the cache) is transposed in shared memory every step, one byte at a time (LDS.U8 and
  PRMT: `lab/results/2026-12-05-mla-fp8-dot-sass.md`), which replaces the conversion's round trip
  rather than removing it.

Page-tag check, fused but out of the token loop: each program first checks the pages its slice uses
in one vectorised pass and sets `tag_mismatch[b]` on a wrong tag. A slice that holds a bad page (its
sequence is about to be aborted) writes a sanitised copy of its part of the page table (-1 for a bad
page) and walks that: a token of a bad page reads zeros (its bytes may be another tenant's NaN) and
scores -inf. In sparse mode the flag must not depend on which tokens were chosen (the reference
checks every page in use), so the first head block's programs of the sequence's last query also
sweep their share of its page list. CHECK_TAGS off reads no tag. A sequence longer than its
page-table row (`seq_len > Mp * S`) is walked over the row's Mp pages only (the bound in
`kernels/triton_lib.py`).

Sparse mode (DSA, GLM-5): `topk_indices [B, K]` lists the token positions the query attends to (-1 =
empty, positions >= seq_len ignored, as the reference does); the slices split the K list, the lines
are gathered one by one. The list must not repeat a position (the indexer's top-k does not): a
repeated one would count twice, where the reference counts it once.

Shapes: B sequences, H heads, R kv_lora_rank, Dr rope dim, P pages, S page size, Mp pages per
sequence in the table, K top-k.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.mla_tiles import MAX_SPLITS, MlaTiles, pick_mla_splits, resolve_tiles, slice_cost_items
from kernels.paged_gather import check_tag_inputs
from kernels.split_k_merge import TL_DTYPES, merge_splits, num_sms
from kernels.triton_lib import QueryTiles, pdl_args, pdl_enter, query_tile


@triton.jit
def check_pages(
    page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, b, page_idx, ok, stride_ptb, stride_etb,
    WRITE: tl.constexpr,
):  # fmt: skip
    """Pages `page_idx [BP]` (where `ok`) of sequence b with the wrong tag; WRITE: also store the
    sanitised ids (-1 for those) at the same places of `clean_table`."""
    page = tl.load(page_table_ptr + b * stride_ptb + page_idx, mask=ok, other=0)
    found = tl.load(page_tags_ptr + page, mask=ok, other=0)
    expected = tl.load(expected_ptr + b * stride_etb + page_idx, mask=ok, other=0)
    bad = ok & (found != expected)
    if WRITE:
        tl.store(clean_table_ptr + b * stride_ptb + page_idx, tl.where(bad, -1, page), mask=ok)
    return tl.sum(bad.to(tl.int32))


@triton.jit
def check_slice(
    page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, topk_ptr, b, t, L, start, end,
    stride_ptb, stride_etb, stride_tkt, PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr,
    SPARSE: tl.constexpr, WRITE: tl.constexpr,
):  # fmt: skip
    """Bad pages among those holding items [start, end) (dense: tokens; SPARSE: query t's chosen
    positions), BLOCK_P independent loads at a time; see `check_pages`."""
    num_bad = 0
    if SPARSE:
        for j0 in range(start, end, BLOCK_P):
            j = j0 + tl.arange(0, BLOCK_P)
            tok = tl.load(topk_ptr + t * stride_tkt + j, mask=j < end, other=-1)
            ok = (tok >= 0) & (tok < L)
            num_bad += check_pages(
                page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, b,
                tl.where(ok, tok, 0) // PAGE_SIZE, ok, stride_ptb, stride_etb, WRITE,
            )  # fmt: skip
    else:
        p_end = tl.cdiv(end, PAGE_SIZE)
        for p0 in range(start // PAGE_SIZE, p_end, BLOCK_P):
            p = p0 + tl.arange(0, BLOCK_P)
            num_bad += check_pages(
                page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, b, p, p < p_end, stride_ptb,
                stride_etb, WRITE,
            )  # fmt: skip
    return num_bad


@triton.jit
def e4m3_to_f16(x):
    """fp8 e4m3 -> fp16, one cvt per pair, as inline asm marked impure: Triton then cannot clone it past
    the layout changes into the two dots' operand layouts, so the tile is converted once and stored in
    shared memory as fp16 for both (`tl.cast` is pushed into each dot's operand: an 8-bit transposed
    operand has no ldmatrix, the tile then goes through registers and the pipeliner gives up on it)."""
    return tl.inline_asm_elementwise(
        "{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; }",
        "=r,=r,r",
        [x],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def e4m3_to_f16_shifted(x):
    """fp8 e4m3 -> fp16 times 2^-8, exact, by moving bits (a byte permute, two logic ops and a shift
    per pair: the integer pipes, not the conversion unit `e4m3_to_f16` uses): the sign stays on top,
    exponent and mantissa shift into fp16's, whose exponent bias is 8 more (subnormals stay exact; the
    NaN byte reads as 1.875). The launcher folds 2^8 into the scales. Impure, as `e4m3_to_f16`."""
    return tl.inline_asm_elementwise(
        "{ .reg .b32 a, b; "
        "prmt.b32 a, $2, 0, 0x1404; prmt.b32 b, $2, 0, 0x3424; "
        "shr.b32 $0, a, 1; and.b32 $0, $0, 0x3F803F80; lop3.b32 $0, a, 0x80008000, $0, 0xEA; "
        "shr.b32 $1, b, 1; and.b32 $1, $1, 0x3F803F80; lop3.b32 $1, b, 0x80008000, $1, 0xEA; }",
        "=r,=r,r",
        [x],
        dtype=tl.float16,
        is_pure=False,
        pack=4,
    )


@triton.jit
def e4m3_bits_to_f16_shifted(x):
    """`e4m3_to_f16_shifted` in plain Triton ops, for the interpreter (which runs no inline asm)."""
    u = x.to(tl.uint8, bitcast=True).to(tl.uint16)
    return (((u & 0x7F) << 7) | ((u & 0x80) << 8)).to(tl.float16, bitcast=True)


@triton.jit
def e4m3_pinned(x):
    """e4m3 `x` unchanged, through an impure `mov` (as `e4m3_to_f16`): the latent chunk then has one
    user, so Triton pipelines its load into shared memory (cp.async, `num_stages`) and reads it back once
    for both dots. Without it the two users (the score dot's operand as loaded, the value dot's
    transposed: fp8 wgmma takes K-major operands only) make Triton load the chunk with plain loads, a
    step at a time, into registers (sm90 SASS of the 16-row swapped tile: LDG.128, no LDGSTS)."""
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.float8e4nv, is_pure=False, pack=4
    )


# e4m3's largest finite value: each q row's absmax maps to it, and p = 1 (the running max)
E4M3_MAX: tl.constexpr = tl.constexpr(448.0)


@triton.jit
def to_e4m3(x, HW: tl.constexpr):
    """fp32 `x` (|x| <= 448) -> e4m3, round to nearest even, subnormals included. HW: the GPU's cast
    (`cvt.rn.satfinite`); else (the interpreter, whose cast neither carries its rounding into the
    exponent nor rounds subnormals) `x` is first rounded in fp32 to a multiple of its e4m3 quantum
    (2^(e - 3), at least 2^-9) by adding and subtracting 1.5 * 2^23 quanta, so the cast is exact."""
    if HW:
        return x.to(tl.float8e4nv)
    e = tl.maximum((x.to(tl.int32, bitcast=True) >> 23) & 0xFF, 127 - 6)  # biased; subnormals: 2^-6's
    magic = ((e + 20) << 23).to(tl.float32, bitcast=True) * 1.5  # 1.5 * 2^23 * 2^(e - 127 - 3)
    return ((x + magic) - magic).to(tl.float8e4nv)


@triton.jit
def e4m3_rows(q_cs, q_pe, NUM_RC: tl.constexpr, HW: tl.constexpr):
    """fp32 q chunks (NUM_RC x [BM, BLOCK_RC]) and rope part [BM, BLOCK_DR] -> their e4m3 codes and each
    row's scale [BM] (q ~ codes x scale): absmax / 448 over the whole row, `q / scale` rounded (IEEE
    divisions: the formula and the bits of `kernels.w4a8_gemm.quantize_fp8_rows_ref`)."""
    amax = tl.max(tl.abs(q_pe), axis=1)
    for k in tl.static_range(NUM_RC):
        amax = tl.maximum(amax, tl.max(tl.abs(q_cs[k]), axis=1))
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), E4M3_MAX)  # [BM]
    codes = ()
    for k in tl.static_range(NUM_RC):
        codes = codes + (to_e4m3(tl.math.div_rn(q_cs[k], scale[:, None]), HW),)
    return codes, to_e4m3(tl.math.div_rn(q_pe, scale[:, None]), HW), scale


@triton.jit
def tile_lines(
    cache_ptr, page, tok, ok, R, DR, stride_cp, stride_cs, PAGE_SIZE: tl.constexpr, BLOCK_RC: tl.constexpr,
    NUM_RC: tl.constexpr, BLOCK_DR: tl.constexpr, COMPUTE: tl.constexpr, FP8_ASM: tl.constexpr,
    FP8_SHIFT: tl.constexpr, FP8_DOT: tl.constexpr,
):  # fmt: skip
    """Tokens `tok [BN]`' latent lines in NUM_RC chunks `[BN, BLOCK_RC]` and rope parts `[BN, BLOCK_DR]`
    (COMPUTE), zero where not `ok`; FP8_SHIFT: FP8 lines times 2^-8 (`e4m3_to_f16_shifted`); FP8_DOT:
    the e4m3 codes as they are (on the GPU the latent chunks `e4m3_pinned`)."""
    line = cache_ptr + page.to(tl.int64) * stride_cp + (tok % PAGE_SIZE) * stride_cs  # [BN]
    offs = tl.arange(0, BLOCK_RC)
    cs = ()
    for k in tl.static_range(NUM_RC):
        r = k * BLOCK_RC + offs
        c = tl.load(line[:, None] + r[None, :], mask=ok[:, None] & (r < R)[None, :], other=0.0)
        if FP8_SHIFT:
            c = e4m3_to_f16_shifted(c) if FP8_ASM else e4m3_bits_to_f16_shifted(c)
        elif FP8_ASM:
            c = e4m3_pinned(c) if FP8_DOT else e4m3_to_f16(c)
        cs = cs + (c.to(COMPUTE),)
    offs_dr = tl.arange(0, BLOCK_DR)
    pe = tl.load(line[:, None] + R + offs_dr[None, :], mask=ok[:, None] & (offs_dr < DR)[None, :], other=0.0)
    if FP8_SHIFT:
        pe = e4m3_to_f16_shifted(pe) if FP8_ASM else e4m3_bits_to_f16_shifted(pe)
    return cs, pe.to(COMPUTE)


@triton.jit
def attend_slice(
    q_cs, q_pe, row_limit, cache_ptr, table_ptr, topk_ptr, b, t, L, start, end, qk_scale, R, DR, stride_cp,
    stride_cs, stride_ptb, stride_tkt, PAGE_SIZE: tl.constexpr, BM: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_RC: tl.constexpr, NUM_RC: tl.constexpr, BLOCK_DR: tl.constexpr, VARLEN: tl.constexpr,
    SPARSE: tl.constexpr, COMPUTE: tl.constexpr, DOT_PRECISION: tl.constexpr, NUM_STAGES: tl.constexpr,
    FP8_ASM: tl.constexpr, FP8_SHIFT: tl.constexpr, SWAP: tl.constexpr, FP8_DOT: tl.constexpr,
):  # fmt: skip
    """Online softmax of the tile's rows (q chunks `q_cs`: NUM_RC x [BM, BLOCK_RC], `q_pe [BM, BLOCK_DR]`,
    COMPUTE) over items [start, end) of sequence b, reading page ids from `table_ptr` (-1: drop the
    page); row r sees tokens below `row_limit[r]` (VARLEN). Returns (max, sum, NUM_RC unnormalised acc
    chunks [BM, BLOCK_RC]; SWAP: [BLOCK_RC, BM]), log2 domain. Every load is masked with other = 0, so
    one zero-filled tile is both key and value: an item past the end, an empty sparse slot, a dropped
    page read 0, not NaN.

    FP8_DOT: q and the lines are e4m3 codes, `qk_scale` a [BM] vector (each row's q scale in it); the
    weights go to the value dot as e4m3 codes of p * 448 and the sum counts those rounded weights, so the
    output is their exact weighted mean (sum and acc both 448x theirs). Each step's value dot starts
    from zero and is added in fp32: Hopper's fp8 MMA keeps ~14 bits of a sum it accumulates, and the
    running acc of 32k tokens would lose the later ones' share.

    SWAP computes the transposed products, tokens as the MMA's rows and the tile's rows (heads) as its
    columns: scores `[BN, BM] = lines · q^T`, acc chunks `[BLOCK_RC, BM] += lines^T · p`. Both dots
    then have 64+ rows (a wgmma warpgroup's M) whatever the head count, the lines are the A operand
    read from shared memory, and q and p the small B operand."""
    AXIS: tl.constexpr = 0 if SWAP else 1  # the scores' token axis
    m = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BM,), dtype=tl.float32)
    accs = ()
    for _ in tl.static_range(NUM_RC):
        if SWAP:
            accs = accs + (tl.zeros((BLOCK_RC, BM), dtype=tl.float32),)
        else:
            accs = accs + (tl.zeros((BM, BLOCK_RC), dtype=tl.float32),)
    for i0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        i = i0 + tl.arange(0, BLOCK_N)
        ok = i < end
        if SPARSE:
            tok = tl.load(topk_ptr + t * stride_tkt + i, mask=ok, other=-1)
            ok = ok & (tok >= 0) & (tok < L)
            tok = tl.where(ok, tok, 0).to(tl.int32)
        else:
            tok = i
        page = tl.load(table_ptr + b * stride_ptb + tok // PAGE_SIZE, mask=ok, other=-1)
        ok = ok & (page >= 0)
        cs, pe = tile_lines(
            cache_ptr, page, tok, ok, R, DR, stride_cp, stride_cs, PAGE_SIZE, BLOCK_RC, NUM_RC, BLOCK_DR,
            COMPUTE, FP8_ASM, FP8_SHIFT, FP8_DOT,
        )  # fmt: skip
        if SWAP:  # [BN, BM]: a column per row of the tile
            s = tl.dot(pe, tl.trans(q_pe), input_precision=DOT_PRECISION)
            for k in tl.static_range(NUM_RC):
                s = tl.dot(cs[k], tl.trans(q_cs[k]), s, input_precision=DOT_PRECISION)
            seen = ok[:, None]
            if VARLEN:
                seen = seen & (tok[:, None] < row_limit[None, :])
        else:  # [BM, BN]
            s = tl.dot(q_pe, tl.trans(pe), input_precision=DOT_PRECISION)
            for k in tl.static_range(NUM_RC):
                s = tl.dot(q_cs[k], tl.trans(cs[k]), s, input_precision=DOT_PRECISION)
            seen = ok[None, :]
            if VARLEN:
                seen = seen & (tok[None, :] < row_limit[:, None])
        if FP8_DOT:
            s = tl.where(seen, s * tl.expand_dims(qk_scale, AXIS), float("-inf"))
        else:
            s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=AXIS))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        alpha = tl.exp2(m - m_base)
        p = tl.exp2(s - tl.expand_dims(m_base, AXIS))
        if FP8_DOT:
            p = to_e4m3(p * E4M3_MAX, FP8_ASM)
            l = l * alpha + tl.sum(p.to(tl.float32), axis=AXIS)
        else:
            l = l * alpha + tl.sum(p, axis=AXIS)
            p = p.to(COMPUTE)
        rescaled = ()
        for k in tl.static_range(NUM_RC):
            if FP8_DOT and SWAP:
                acc = accs[k] * alpha[None, :] + tl.dot(tl.trans(cs[k]), p)
            elif FP8_DOT:
                acc = accs[k] * alpha[:, None] + tl.dot(p, cs[k])
            elif SWAP:
                acc = tl.dot(tl.trans(cs[k]), p, accs[k] * alpha[None, :], input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(p, cs[k], accs[k] * alpha[:, None], input_precision=DOT_PRECISION)
            rescaled = rescaled + (acc,)
        accs = rescaled
        m = m_new
    return m, l, accs


# the per-step integers: a value of 1 or a multiple of 16 would otherwise compile a variant of its own
# (a prefill of several prompts, a page table of another width) that the warm-up never ran
@triton.jit(
    do_not_specialize=["num_seqs", "num_splits", "topk", "num_cols", "stride_ptb", "stride_etb", "stride_tkt"]
)
def _mla_paged_kernel(
    q_ptr,  # [T, H, R + Dr] (decode: T = B)
    cache_ptr,  # [P, S, R + Dr]
    page_table_ptr,  # [B, Mp] int32
    clean_table_ptr,  # [B, Mp] int32 scratch, page_table's strides: sanitised ids (CHECK_TAGS only)
    expected_ptr,  # [B, Mp] int64
    page_tags_ptr,  # [P] int64
    seq_lens_ptr,  # [B] int32
    query_start_ptr,  # [B+1] int32 (VARLEN only)
    tile_seq_ptr,  # [NT] int32 sequence of each query tile, >= B = no tile (VARLEN only)
    tile_q0_ptr,  # [NT] int32 first query row of each tile (VARLEN only)
    topk_ptr,  # [T, K] int32/int64 token positions, -1 = empty (sparse mode only)
    mismatch_ptr,  # [B] uint8 (the bool flags, viewed)
    part_o_ptr,  # [T, H, NS, R] fp32 (unused when DIRECT)
    part_lse_ptr,  # [T, H, NS] fp32, log2 domain (unused when DIRECT)
    out_ptr,  # [T, H, R] q's dtype (DIRECT only)
    qk_scale,  # softmax_scale * latent_scale * log2(e) (FP8_SHIFT: * 2^8; FP8_DOT: each row's q scale too)
    v_scale,  # latent_scale (FP8_SHIFT: * 2^8; DIRECT only)
    num_seqs, num_splits, num_heads, R, DR, topk, num_cols,  # num_cols: the page table's width, Mp
    stride_qt, stride_qh, stride_cp, stride_cs, stride_ptb, stride_etb, stride_tkt, stride_ot, stride_oh,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # queries per program (1 for decode and sparse mode)
    BLOCK_H: tl.constexpr,  # heads per program; rows of the tile = BLOCK_Q * BLOCK_H
    BLOCK_N: tl.constexpr,  # tokens per step
    BLOCK_RC: tl.constexpr,  # latent columns per chunk
    NUM_RC: tl.constexpr,  # chunks: NUM_RC * BLOCK_RC >= R
    BLOCK_DR: tl.constexpr,
    BLOCK_P: tl.constexpr,  # pages (sparse: positions) per step of the tag check
    VARLEN: tl.constexpr,  # tiles of several queries per sequence, causal (prefill); else one per sequence
    SPARSE: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    DIRECT: tl.constexpr,  # one slice: write the final output, skip the partials
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 caches (FP8_DOT: e4m3), else q's
    DOT_PRECISION: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # the token loop's pipeline depth
    FP8_ASM: tl.constexpr,  # an FP8 cache on the GPU: convert with `e4m3_to_f16` (no asm in the interpreter),
    # FP8_DOT: round to e4m3 by the GPU's cast (`to_e4m3`)
    FP8_SHIFT: tl.constexpr,  # an FP8 cache converted by `e4m3_to_f16_shifted` (x 2^-8, in the scales)
    SWAP: tl.constexpr,  # tokens as the dots' rows (`attend_slice`)
    FP8_DOT: tl.constexpr,  # an FP8 cache read by e4m3 dots: q rounded to e4m3 per row, p too (`attend_slice`)
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):  # fmt: skip
    pdl_enter(PDL)
    hb = tl.program_id(0)
    split = tl.program_id(1)
    tile = tl.program_id(2)
    if VARLEN:
        b, tile_ok, q0, num_q, L, first_pos, is_last = query_tile(
            tile_seq_ptr, tile_q0_ptr, query_start_ptr, seq_lens_ptr, tile, num_seqs, BLOCK_Q
        )
    else:
        b = tile
        tile_ok = True
        q0 = tile
        num_q = 1
        L = tl.load(seq_lens_ptr + b)
        first_pos = L - 1
        is_last = True
    t = q0.to(tl.int64)
    # never a token past the row (the bound in `kernels/triton_lib.py`)
    L = tl.minimum(L, num_cols * PAGE_SIZE)
    num_items = topk if SPARSE else tl.minimum(first_pos + num_q, L)  # dense: the tile's last query sees
    num_items = tl.where(tile_ok, num_items, 0)
    per_split = tl.cdiv(tl.cdiv(num_items, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, num_items)

    # the tile's queries, chunked as the latent (loaded before the tag check: fewer registers so)
    BM: tl.constexpr = BLOCK_Q * BLOCK_H
    rows = tl.arange(0, BM)
    qi = rows // BLOCK_H  # [BM] query of the row within the tile
    heads = hb * BLOCK_H + rows % BLOCK_H  # [BM]
    row_ok = (qi < num_q) & (heads < num_heads)
    t_row = (q0 + qi).to(tl.int64)  # [BM] row of T
    q_row = q_ptr + t_row[:, None] * stride_qt + heads[:, None] * stride_qh  # [BM, 1]
    offs_rc = tl.arange(0, BLOCK_RC)
    q_cs = ()
    for k in tl.static_range(NUM_RC):
        r = k * BLOCK_RC + offs_rc
        q_c = tl.load(q_row + r[None, :], mask=row_ok[:, None] & (r < R)[None, :], other=0.0)
        q_cs = q_cs + (q_c.to(tl.float32 if FP8_DOT else COMPUTE),)
    offs_dr = tl.arange(0, BLOCK_DR)
    q_pe = tl.load(q_row + R + offs_dr[None, :], mask=row_ok[:, None] & (offs_dr < DR)[None, :], other=0.0)
    row_scale = qk_scale
    if FP8_DOT:
        q_cs, q_pe, q_scale = e4m3_rows(q_cs, q_pe.to(tl.float32), NUM_RC, FP8_ASM)
        row_scale = q_scale * qk_scale

    # the tag check, out of the token loop: one vectorised pass over the pages the slice uses. A slice
    # with a bad page (its sequence is about to be aborted) writes a sanitised copy of its part of the
    # page table (-1 for a bad page) and walks that; the others walk the page table itself.
    table_ptr = page_table_ptr
    if CHECK_TAGS:
        num_bad = check_slice(
            page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, topk_ptr, b, t, L, start, end,
            stride_ptb, stride_etb, stride_tkt, PAGE_SIZE, BLOCK_P, SPARSE, False,
        )  # fmt: skip
        tl.store(mismatch_ptr + b, 1, mask=num_bad > 0)
        if num_bad > 0:
            check_slice(
                page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, topk_ptr, b, t, L, start, end,
                stride_ptb, stride_etb, stride_tkt, PAGE_SIZE, BLOCK_P, SPARSE, True,
            )  # fmt: skip
            tl.debug_barrier()  # the program reads back only ids it wrote itself: no other CTA's
            table_ptr = clean_table_ptr

    m, l, accs = attend_slice(
        q_cs, q_pe.to(COMPUTE), first_pos + qi + 1, cache_ptr, table_ptr, topk_ptr, b, t, L, start, end,
        row_scale, R, DR, stride_cp, stride_cs, stride_ptb, stride_tkt, PAGE_SIZE, BM, BLOCK_N, BLOCK_RC,
        NUM_RC, BLOCK_DR, VARLEN, SPARSE, COMPUTE, DOT_PRECISION, NUM_STAGES, FP8_ASM, FP8_SHIFT, SWAP,
        FP8_DOT,
    )  # fmt: skip

    l_safe = tl.where(l > 0.0, l, 1.0)
    part_row = (t_row * num_heads + heads) * num_splits + split  # [BM] index into [T, H, NS]
    for k in tl.static_range(NUM_RC):
        r = k * BLOCK_RC + offs_rc
        if SWAP:  # acc chunks [BLOCK_RC, BM]: stored through transposed pointers
            store_ok = row_ok[None, :] & (r < R)[:, None]
            o = accs[k] / l_safe[None, :]
            out = out_ptr + t_row[None, :] * stride_ot + heads[None, :] * stride_oh + r[:, None]
            part = part_o_ptr + part_row[None, :] * R + r[:, None]
        else:
            store_ok = row_ok[:, None] & (r < R)[None, :]
            o = accs[k] / l_safe[:, None]
            out = out_ptr + t_row[:, None] * stride_ot + heads[:, None] * stride_oh + r[None, :]
            part = part_o_ptr + part_row[:, None] * R + r[None, :]
        if DIRECT:  # no visible token: 0
            tl.store(out, (o * v_scale).to(out_ptr.dtype.element_ty), mask=store_ok)
        else:
            tl.store(part, o, mask=store_ok)
    if not DIRECT:
        lse = m + tl.log2(l_safe / E4M3_MAX) if FP8_DOT else m + tl.log2(l_safe)  # FP8_DOT: l is 448x the sum
        tl.store(part_lse_ptr + part_row, tl.where(l > 0.0, lse, float("-inf")), mask=row_ok)

    if CHECK_TAGS and SPARSE and (hb == 0) & is_last:
        # the flag covers every page in use, chosen or not (as the reference's): swept by the first
        # head block of the sequence's last query, a share of the tokens per slice (here, after the
        # token loop, not to hold its registers through it)
        per_sweep = tl.cdiv(tl.cdiv(L, PAGE_SIZE), num_splits) * PAGE_SIZE
        swept_bad = check_slice(
            page_table_ptr, expected_ptr, page_tags_ptr, clean_table_ptr, topk_ptr, b, t, L, split * per_sweep,
            tl.minimum((split + 1) * per_sweep, L), stride_ptb, stride_etb, stride_tkt, PAGE_SIZE, BLOCK_P,
            False, False,
        )  # fmt: skip
        tl.store(mismatch_ptr + b, 1, mask=swept_bad > 0)


def check_mla_inputs(
    q: torch.Tensor,
    latent_cache: torch.Tensor,
    kv_lora_rank: int,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    page_tags: torch.Tensor,
    tag_mismatch: torch.Tensor,
    topk_indices: torch.Tensor | None,
    block_h: int,
    block_n: int,
) -> None:
    """Shapes, dtypes and strides both launchers (decode and prefill) need; raises on the first misfit."""
    T, H, C = q.shape
    B = seq_lens.shape[0]
    R = kv_lora_rank
    if latent_cache.dim() != 3 or latent_cache.shape[2] != C or not 0 < R < C:
        raise ValueError(f"q {tuple(q.shape)} and cache {tuple(latent_cache.shape)} with R={R} do not fit")
    if q.dtype not in TL_DTYPES:
        raise TypeError(f"q must be fp16, bf16 or fp32, got {q.dtype}")
    if latent_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(f"latent cache must be {q.dtype} or float8_e4m3fn, got {latent_cache.dtype}")
    check_tag_inputs(page_table, expected_tags, page_tags)
    if seq_lens.shape != (B,) or page_table.shape[0] != B:
        raise ValueError("seq_lens [B], page_table [B, Mp] and expected_tags [B, Mp] must agree")
    if tag_mismatch.shape != (B,) or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    if q.stride(2) != 1 or latent_cache.stride(2) != 1:
        raise ValueError("the last dimension of q and latent_cache must be contiguous")
    if topk_indices is not None:
        if topk_indices.dim() != 2 or topk_indices.shape[0] != T or topk_indices.stride(1) != 1:
            raise ValueError(
                f"topk_indices must be [T, K] with contiguous rows, got {tuple(topk_indices.shape)}"
            )
        if topk_indices.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"topk_indices must be int32 or int64, got {topk_indices.dtype}")
    if block_h < 1 or block_h & (block_h - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_h and block_n must be powers of two, block_n >= 16 (tl.dot tiles)")


def launch_mla_paged(
    q: torch.Tensor,  # [T, H, R + Dr], checked by check_mla_inputs
    latent_cache: torch.Tensor,
    latent_scale: float,
    kv_lora_rank: int,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    page_tags: torch.Tensor,
    tag_mismatch: torch.Tensor,
    softmax_scale: float,
    topk_indices: torch.Tensor | None,
    query_tiles: QueryTiles | None,  # None: decode, program tile b = sequence b's one query
    *,
    num_splits: int | None,
    check_tags: bool,
    tiles: MlaTiles,
) -> torch.Tensor:  # [T, H, R] in q's dtype
    """Stage 1 over `(head blocks, slices, tiles)`, then the merge when there is more than one slice."""
    T, H, C = q.shape
    S = latent_cache.shape[1]
    R = kv_lora_rank
    out = torch.empty((T, H, R), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    block_q = 1 if query_tiles is None else query_tiles.block_q
    if block_q * tiles.block_h < 16:
        raise ValueError("block_q * block_h must be at least 16 (the rows of a tl.dot tile)")
    if tiles.block_rc < 16 or tiles.block_rc & (tiles.block_rc - 1):
        raise ValueError(f"block_rc must be a power of two >= 16, got {tiles.block_rc}")
    fp8 = latent_cache.dtype == torch.float8_e4m3fn
    fp8_dot = fp8 and tiles.fp8_dot
    least_k = 32 if fp8_dot else 16  # an 8-bit dot's K: the latent and rope chunks, and the tokens of a step
    if fp8_dot and tiles.block_n < least_k:
        raise ValueError(f"fp8_dot tiles need block_n >= 32 (the value dot's K), got {tiles.block_n}")
    block_rc = min(tiles.block_rc, max(least_k, triton.next_power_of_2(R)))
    sparse = topk_indices is not None
    K = topk_indices.shape[1] if topk_indices is not None else 0
    num_tiles = T if query_tiles is None else query_tiles.tile_seq.shape[0]
    head_blocks = triton.cdiv(H, tiles.block_h)
    max_items = K if sparse else page_table.shape[1] * S
    line_bytes = C * latent_cache.element_size()
    splits = num_splits or pick_mla_splits(
        num_tiles, head_blocks, max_items, num_sms(q.device), tiles.ctas_per_sm,
        slice_cost_items(block_q * tiles.block_h, R, line_bytes), tiles.block_n,
    )  # fmt: skip
    if splits > MAX_SPLITS:
        raise ValueError(f"at most {MAX_SPLITS} slices, got {splits}")
    direct = splits == 1
    if direct:
        part_o = part_lse = out  # not read: the kernel writes `out` itself
    else:
        part_o = torch.empty((T, H, splits, R), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    # written (then read) only by a slice that holds a page with the wrong tag
    clean_table = (
        torch.empty_strided(page_table.shape, page_table.stride(), dtype=torch.int32, device=q.device)
        if check_tags
        else page_table
    )
    topk_arg = topk_indices if topk_indices is not None else page_table  # dense: any pointer, never read
    query_start, tile_seq, tile_q0 = (
        (seq_lens,) * 3
        if query_tiles is None
        else (query_tiles.query_start, query_tiles.tile_seq, query_tiles.tile_q0)
    )
    shift = fp8 and tiles.fp8_shift and not fp8_dot
    line_scale = latent_scale * 256.0 if shift else latent_scale  # shifted lines read 2^-8 of their value
    block_p = 512 if sparse else 1024  # the tag check of a 16k-token slice in one step (sparse: registers)
    _mla_paged_kernel[(head_blocks, splits, num_tiles)](
        q, latent_cache, page_table, clean_table, expected_tags, page_tags, seq_lens, query_start, tile_seq,
        tile_q0, topk_arg, tag_mismatch.view(torch.uint8), part_o, part_lse, out,
        softmax_scale * line_scale * math.log2(math.e), line_scale, seq_lens.shape[0], splits, H, R, C - R,
        K, page_table.shape[1],
        q.stride(0), q.stride(1), latent_cache.stride(0), latent_cache.stride(1), page_table.stride(0),
        expected_tags.stride(0), topk_arg.stride(0), out.stride(0), out.stride(1),
        PAGE_SIZE=S, BLOCK_Q=block_q, BLOCK_H=tiles.block_h, BLOCK_N=tiles.block_n, BLOCK_RC=block_rc,
        NUM_RC=triton.cdiv(R, block_rc), BLOCK_DR=max(least_k, triton.next_power_of_2(C - R)),
        BLOCK_P=block_p, VARLEN=query_tiles is not None, SPARSE=sparse, CHECK_TAGS=check_tags, DIRECT=direct,
        COMPUTE=tl.float8e4nv if fp8_dot else tl.float16 if fp8 else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_STAGES=tiles.num_stages, FP8_ASM=fp8 and q.is_cuda,  # the interpreter runs no inline asm
        FP8_SHIFT=shift, SWAP=tiles.swap, FP8_DOT=fp8_dot, **pdl_args(q.device),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    if not direct:
        merge_splits(part_o, part_lse, out, line_scale)
    return out


def mla_decode(
    q: torch.Tensor,  # [B, H, R + Dr] fp16 / bf16 / fp32, absorbed
    latent_cache: torch.Tensor,  # [P, S, R + Dr] q's dtype or float8_e4m3fn
    latent_scale: float,
    kv_lora_rank: int,
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache including the new one
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, set (never cleared) where a page's tag is wrong
    softmax_scale: float,
    topk_indices: torch.Tensor | None = None,  # [B, K] int32/int64 positions, -1 padded, no repeats
    *,
    num_splits: int | None = None,
    check_tags: bool = True,  # False only to measure the check's cost
    block_h: int | None = None,
    block_n: int | None = None,
    block_rc: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    tiles: MlaTiles | None = None,
    fp8_dot: bool = False,
) -> torch.Tensor:  # [B, H, R] in q's dtype
    """`mla_attention_ref` for one query per sequence (query_start = 0..B); see the module docstring.

    Tile defaults (None): `tiles` if given (a whole config, as the benchmark's sweep passes them), else
    `kernels.mla_tiles.TILES` for the heads (a 64-row tile from 33 heads on), the cache dtype and the
    mode (`fp8_dot` with an FP8 cache: `FP8_DOT_TILES`, e4m3 dots, other numerics); any of block_h ...
    num_stages given replaces that field.
    """
    if q.dim() != 3 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode takes one query per sequence: q {tuple(q.shape)}, {seq_lens.shape[0]} sequences"
        )
    tiles = resolve_tiles(
        "decode" if topk_indices is None else "sparse", block_h or q.shape[1],
        latent_cache.dtype == torch.float8_e4m3fn, block_h, block_n, block_rc, num_warps, num_stages, tiles,
        fp8_dot,
    )  # fmt: skip
    check_mla_inputs(
        q, latent_cache, kv_lora_rank, seq_lens, page_table, expected_tags, page_tags, tag_mismatch,
        topk_indices, tiles.block_h, tiles.block_n,
    )  # fmt: skip
    if tiles.block_h < 16:
        raise ValueError("decode needs block_h >= 16 (the rows of a tl.dot tile)")
    return launch_mla_paged(
        q, latent_cache, latent_scale, kv_lora_rank, seq_lens, page_table, expected_tags, page_tags,
        tag_mismatch, softmax_scale, topk_indices, None, num_splits=num_splits, check_tags=check_tags,
        tiles=tiles,
    )  # fmt: skip

"""Paged MLA decode attention (one new token per sequence), BF16 or FP8 e4m3 latent cache, tag-checked.

The cache holds one `[R + Dr]` line per token (576 for Kimi K2 / GLM-5: latent `c` then rotated
`k_pe`); queries come absorbed (`[q_nope · W_UK | q_pe]`), so this is MQA with one shared "head":
the key is the whole line, the value its first R dims (engine-anchors §1d, §2c).

Split-K: stage 1 (`_mla_paged_kernel`, grid `(H / BLOCK_H, splits, B)`) walks one slice of one
sequence for BLOCK_H heads at once — each latent tile is loaded once and used by two `tl.dot`s for
the scores (`q_c · c`, `q_pe · k_pe`) and one for the output (`p · c`) — with an online softmax, and
writes the normalised partial output and its log-sum-exp (log2 domain). Stage 2 (`kernels.split_k_merge`,
grid `(B, H)`) merges the slices. With one slice stage 1 writes the output itself (no merge). The head
blocks are the fastest grid axis so the programs that share a slice of latent run side by side and
the other head blocks' reads of it hit the L2. The slice count is chosen on the host from batch, heads
and the page table's width (never a device read), so the launch can be captured in a CUDA graph.
The same kernel serves prefill (`kernels/mla_prefill.py`: VARLEN, a tile of BLOCK_Q queries × BLOCK_H
heads per program, causal per row); decode is its BLOCK_Q = 1, one-tile-per-sequence case.

Sparse mode (DSA, GLM-5): `topk_indices [B, K]` lists the token positions the query attends to (-1 =
empty, positions >= seq_len ignored, as the reference does); the slices then split the K list, and
the tokens are gathered line by line. The list must not repeat a position (the indexer's top-k does
not): a repeated one would count twice, where the reference counts it once.

Page-tag check, fused: each token's page tag is compared with the sequence's expected tag for that
page; a token of a mismatched page gets a -inf score and a zero value row (its bytes may be another
tenant's NaN), and `tag_mismatch[b]` is set. By default the line loads do not wait for the tag loads
and a select zeroes the failed rows after them; `masked_loads=True` puts the check in the load masks
instead (a failed page is never read; one tile fewer in registers, but the loads wait for the tags):
which is faster is the H200 benchmark's call. In sparse mode the flag must not depend on which
tokens were chosen (the reference checks every page in use), so the first head block's programs
of the sequence's last query also sweep their share of its page list.

FP8: the line is converted to fp16 for the dots (e4m3 -> fp16 is one cvt; q is cast to fp16, so an
absorbed query above 65504 would overflow) and the layer's single scale folds into the softmax scale
and into the output (K and V are the same line, so one scale). At Kimi's 64 heads that is 2·(576 +
512)·64 FLOP per 576-byte FP8 line, 242 FLOP/B: 16-bit tensor cores, not HBM, bound it on an H200
(4.27 TB/s would take ~1,030 TFLOP/s); a TP shard of 8 or 16 heads is HBM-bound.

Shapes: B sequences, H heads, R kv_lora_rank, Dr rope dim, P pages, S page size, Mp pages per
sequence in the table, K top-k.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.split_k_merge import TL_DTYPES, merge_splits, num_sms


@triton.jit
def query_tile(
    tile_seq_ptr,  # [NT] int32 sequence of each tile, >= B = idle
    tile_q0_ptr,  # [NT] int32 first query row of each tile
    query_start_ptr,  # [B+1] int32
    seq_lens_ptr,  # [B] int32
    tile,
    num_seqs,
    BLOCK_Q: tl.constexpr,
):
    """Prefill tile `tile` of a `QueryTiles` grid: (sequence b, tile_ok, first query row q0, its
    query count, the sequence's length L, the position of query q0, whether the tile holds the
    sequence's last query). An idle tile (the grid is an upper bound) gets b = 0 and no query."""
    b = tl.load(tile_seq_ptr + tile)
    tile_ok = b < num_seqs
    b = tl.where(tile_ok, b, 0)
    q_beg = tl.load(query_start_ptr + b)
    q_end = tl.load(query_start_ptr + b + 1)
    q0 = tl.where(tile_ok, tl.load(tile_q0_ptr + tile), q_beg)
    num_q = tl.where(tile_ok, tl.minimum(q_end - q0, BLOCK_Q), 0)
    L = tl.load(seq_lens_ptr + b)
    first_pos = L - (q_end - q_beg) + (q0 - q_beg)
    is_last = tile_ok & (q0 + num_q == q_end)
    return b, tile_ok, q0, num_q, L, first_pos, is_last


@triton.jit
def _mla_paged_kernel(
    q_ptr,  # [T, H, R + Dr] (decode: T = B)
    cache_ptr,  # [P, S, R + Dr]
    page_table_ptr,  # [B, Mp] int32
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
    qk_scale,  # softmax_scale * latent_scale * log2(e)
    v_scale,  # latent_scale (DIRECT only)
    num_seqs,
    num_splits,
    num_heads,
    R,
    DR,
    topk,
    stride_qt,
    stride_qh,
    stride_cp,
    stride_cs,
    stride_ptb,
    stride_etb,
    stride_tkt,
    stride_ot,
    stride_oh,
    PAGE_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,  # queries per program (1 for decode and sparse mode)
    BLOCK_H: tl.constexpr,  # heads per program; rows of the tile = BLOCK_Q * BLOCK_H
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_DR: tl.constexpr,
    BLOCK_P: tl.constexpr,
    VARLEN: tl.constexpr,  # tiles of several queries per sequence, causal (prefill); else one per sequence
    SPARSE: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    MASKED_LOADS: tl.constexpr,  # the tag check masks the line loads instead of selecting after them
    DIRECT: tl.constexpr,  # one slice: write the final output, skip the partials
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 caches, else q's
    DOT_PRECISION: tl.constexpr,
):
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
    num_items = topk if SPARSE else first_pos + num_q  # dense: the tile's last query sees that many
    num_items = tl.where(tile_ok, num_items, 0)
    per_split = tl.cdiv(tl.cdiv(num_items, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, num_items)

    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = rows // BLOCK_H  # [BM] query of the row within the tile
    heads = hb * BLOCK_H + rows % BLOCK_H  # [BM]
    row_ok = (qi < num_q) & (heads < num_heads)
    row_limit = first_pos + qi + 1  # [BM] tokens the row's query may see (causal)
    t_row = (q0 + qi).to(tl.int64)  # [BM] row of T
    offs_r = tl.arange(0, BLOCK_R)
    offs_dr = tl.arange(0, BLOCK_DR)
    r_ok = offs_r < R
    dr_ok = offs_dr < DR
    q_row = q_ptr + t_row[:, None] * stride_qt + heads[:, None] * stride_qh
    q_c = tl.load(q_row + offs_r[None, :], mask=row_ok[:, None] & r_ok[None, :], other=0.0).to(COMPUTE)
    q_pe = tl.load(q_row + R + offs_dr[None, :], mask=row_ok[:, None] & dr_ok[None, :], other=0.0).to(COMPUTE)

    m = tl.full((BLOCK_Q * BLOCK_H,), float("-inf"), dtype=tl.float32)
    l = tl.zeros((BLOCK_Q * BLOCK_H,), dtype=tl.float32)
    acc = tl.zeros((BLOCK_Q * BLOCK_H, BLOCK_R), dtype=tl.float32)
    num_bad = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for i0 in range(start, end, BLOCK_N):
        i = i0 + tl.arange(0, BLOCK_N)
        i_ok = i < end
        if SPARSE:  # BLOCK_Q == 1: the tile's one query has its own list
            tok = tl.load(topk_ptr + q0.to(tl.int64) * stride_tkt + i, mask=i_ok, other=-1)
            n_ok = i_ok & (tok >= 0) & (tok < L)
            tok = tl.where(n_ok, tok, 0)
        else:
            tok = i
            n_ok = i_ok
        page_idx = tok // PAGE_SIZE
        page = tl.load(page_table_ptr + b * stride_ptb + page_idx, mask=n_ok, other=0)
        if CHECK_TAGS:
            found = tl.load(page_tags_ptr + page, mask=n_ok, other=0)
            expected = tl.load(expected_ptr + b * stride_etb + page_idx, mask=n_ok, other=0)
            tok_ok = n_ok & (found == expected)
            num_bad += (n_ok & (found != expected)).to(tl.int32)
        else:
            tok_ok = n_ok
        # MASKED_LOADS: a failed page is never read (the loads wait for the tags); otherwise the loads
        # wait only for the page ids and a failed page is dropped by the selects below
        ld_ok = tok_ok if MASKED_LOADS else n_ok
        line = cache_ptr + page.to(tl.int64) * stride_cp + (tok % PAGE_SIZE).to(tl.int64) * stride_cs  # [BN]
        c = tl.load(line[:, None] + offs_r[None, :], mask=ld_ok[:, None] & r_ok[None, :], other=0.0)
        pe = tl.load(line[:, None] + R + offs_dr[None, :], mask=ld_ok[:, None] & dr_ok[None, :], other=0.0)
        c = c.to(COMPUTE)
        s = tl.dot(q_c, tl.trans(c), input_precision=DOT_PRECISION)
        s += tl.dot(q_pe, tl.trans(pe.to(COMPUTE)), input_precision=DOT_PRECISION)  # [BM, BN]
        seen = tok_ok[None, :]
        if VARLEN:
            seen = seen & (tok[None, :] < row_limit[:, None])
        s = tl.where(seen, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        m_base = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing seen yet: keep exp2 finite
        alpha = tl.exp2(m - m_base)
        p = tl.exp2(s - m_base[:, None])  # [BM, BN]
        l = l * alpha + tl.sum(p, axis=1)
        v = c if MASKED_LOADS else tl.where(tok_ok[:, None], c, 0.0)  # 0 · NaN would poison the row
        acc = acc * alpha[:, None] + tl.dot(p.to(COMPUTE), v, input_precision=DOT_PRECISION)
        m = m_new

    if CHECK_TAGS:
        if SPARSE:
            # the flag covers every page in use, chosen or not (as the reference's): swept by the
            # first head block of the sequence's last query
            if (hb == 0) & is_last:
                num_pages = tl.cdiv(L, PAGE_SIZE)
                pages_per_split = tl.cdiv(tl.cdiv(num_pages, num_splits), BLOCK_P) * BLOCK_P
                p_end = tl.minimum((split + 1) * pages_per_split, num_pages)
                bad_pages = tl.zeros((BLOCK_P,), dtype=tl.int32)
                for j0 in range(split * pages_per_split, p_end, BLOCK_P):
                    j = j0 + tl.arange(0, BLOCK_P)
                    j_ok = j < p_end
                    pg = tl.load(page_table_ptr + b * stride_ptb + j, mask=j_ok, other=0)
                    f = tl.load(page_tags_ptr + pg, mask=j_ok, other=0)
                    e = tl.load(expected_ptr + b * stride_etb + j, mask=j_ok, other=0)
                    bad_pages += (j_ok & (f != e)).to(tl.int32)
                tl.store(mismatch_ptr + b, 1, mask=tl.sum(bad_pages) > 0)
        else:
            tl.store(mismatch_ptr + b, 1, mask=tl.sum(num_bad) > 0)

    l_safe = tl.where(l > 0.0, l, 1.0)
    if DIRECT:
        o = acc / l_safe[:, None] * v_scale  # no visible token: 0
        out = out_ptr + t_row[:, None] * stride_ot + heads[:, None] * stride_oh + offs_r[None, :]
        tl.store(out, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & r_ok[None, :])
    else:
        lse = tl.where(l > 0.0, m + tl.log2(l_safe), float("-inf"))
        part_row = (t_row * num_heads + heads) * num_splits + split  # [BM] index into [T, H, NS]
        part = part_o_ptr + part_row[:, None] * R + offs_r[None, :]
        tl.store(part, acc / l_safe[:, None], mask=row_ok[:, None] & r_ok[None, :])
        tl.store(part_lse_ptr + part_row, lse, mask=row_ok)


def pick_num_splits(batch: int, head_blocks: int, max_items: int, num_sms: int) -> int:
    """Slices per sequence: about two programs per SM, each slice at least 256 tokens, at most 64."""
    want = triton.cdiv(2 * num_sms, max(batch * head_blocks, 1))
    return max(1, min(want, triton.cdiv(max_items, 256), 64))


@dataclass(frozen=True, slots=True)
class QueryTiles:
    """The prefill grid: program tile i covers queries `tile_q0[i] ..+ block_q` of sequence
    `tile_seq[i]` (>= B: an idle tile). Built on the device, so no host sync (see `mla_prefill`)."""

    query_start: torch.Tensor  # [B+1] int32
    tile_seq: torch.Tensor  # [NT] int32
    tile_q0: torch.Tensor  # [NT] int32
    block_q: int


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
    if seq_lens.shape != (B,) or page_table.shape[0] != B or expected_tags.shape != page_table.shape:
        raise ValueError("seq_lens [B], page_table [B, Mp] and expected_tags [B, Mp] must agree")
    if (
        page_table.dtype != torch.int32
        or expected_tags.dtype != torch.int64
        or page_tags.dtype != torch.int64
    ):
        raise TypeError("page_table must be int32, expected_tags and page_tags int64")
    if tag_mismatch.shape != (B,) or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    if q.stride(2) != 1 or latent_cache.stride(2) != 1:
        raise ValueError("the last dimension of q and latent_cache must be contiguous")
    if page_table.stride(1) != 1 or expected_tags.stride(1) != 1:
        raise ValueError("page_table and expected_tags rows must be contiguous")
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
    tiles: QueryTiles | None,  # None: decode, program tile b = sequence b's one query
    *,
    num_splits: int | None,
    check_tags: bool,
    block_h: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    masked_loads: bool = False,
) -> torch.Tensor:  # [T, H, R] in q's dtype
    """Stage 1 over `(head blocks, slices, tiles)`, then the merge when there is more than one slice."""
    T, H, C = q.shape
    S = latent_cache.shape[1]
    R = kv_lora_rank
    out = torch.empty((T, H, R), dtype=q.dtype, device=q.device)
    if T == 0:
        return out
    block_q = 1 if tiles is None else tiles.block_q
    if block_q * block_h < 16:
        raise ValueError("block_q * block_h must be at least 16 (the rows of a tl.dot tile)")
    sparse = topk_indices is not None
    K = topk_indices.shape[1] if topk_indices is not None else 0
    num_tiles = T if tiles is None else tiles.tile_seq.shape[0]
    head_blocks = triton.cdiv(H, block_h)
    max_items = K if sparse else page_table.shape[1] * S
    splits = num_splits or pick_num_splits(num_tiles, head_blocks, max_items, num_sms(q.device))
    direct = splits == 1
    if direct:
        part_o = part_lse = out  # not read: the kernel writes `out` itself
    else:
        part_o = torch.empty((T, H, splits, R), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, H, splits), dtype=torch.float32, device=q.device)
    topk_arg = topk_indices if topk_indices is not None else page_table  # dense: any pointer, never read
    query_start, tile_seq, tile_q0 = (
        (seq_lens,) * 3 if tiles is None else (tiles.query_start, tiles.tile_seq, tiles.tile_q0)
    )
    _mla_paged_kernel[(head_blocks, splits, num_tiles)](
        q,
        latent_cache,
        page_table,
        expected_tags,
        page_tags,
        seq_lens,
        query_start,
        tile_seq,
        tile_q0,
        topk_arg,
        tag_mismatch.view(torch.uint8),
        part_o,
        part_lse,
        out,
        softmax_scale * latent_scale * math.log2(math.e),
        latent_scale,
        seq_lens.shape[0],
        splits,
        H,
        R,
        C - R,
        K,
        q.stride(0),
        q.stride(1),
        latent_cache.stride(0),
        latent_cache.stride(1),
        page_table.stride(0),
        expected_tags.stride(0),
        topk_arg.stride(0),
        out.stride(0),
        out.stride(1),
        PAGE_SIZE=S,
        BLOCK_Q=block_q,
        BLOCK_H=block_h,
        BLOCK_N=block_n,
        BLOCK_R=max(16, triton.next_power_of_2(R)),
        BLOCK_DR=max(16, triton.next_power_of_2(C - R)),
        BLOCK_P=128,
        VARLEN=tiles is not None,
        SPARSE=sparse,
        CHECK_TAGS=check_tags,
        MASKED_LOADS=masked_loads,
        DIRECT=direct,
        COMPUTE=tl.float16 if latent_cache.dtype == torch.float8_e4m3fn else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if not direct:
        merge_splits(part_o, part_lse, out, latent_scale)
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
    num_warps: int | None = None,
    num_stages: int = 2,
    masked_loads: bool = False,  # the tag check masks the loads (fewer registers, loads wait for tags)
) -> torch.Tensor:  # [B, H, R] in q's dtype
    """`mla_attention_ref` for one query per sequence (query_start = 0..B); see the module docstring.

    Tile defaults (None) are the configs ptxas compiles for sm90 without spills
    (`python -m tests.kernels.sm90_compile --all`), not yet measured: 32 heads × 16 tokens on 8
    warps (16 heads × 16 tokens on 4 where H <= 16), 32 tokens for a dense FP8 cache.
    """
    if q.dim() != 3 or q.shape[0] != seq_lens.shape[0]:
        raise ValueError(
            f"decode takes one query per sequence: q {tuple(q.shape)}, {seq_lens.shape[0]} sequences"
        )
    block_h = block_h or (16 if q.shape[1] <= 16 else 32)
    block_n = block_n or (32 if latent_cache.dtype == torch.float8_e4m3fn and topk_indices is None else 16)
    num_warps = num_warps or (4 if block_h <= 16 else 8)
    check_mla_inputs(
        q, latent_cache, kv_lora_rank, seq_lens, page_table, expected_tags, page_tags, tag_mismatch,
        topk_indices, block_h, block_n,
    )  # fmt: skip
    if block_h < 16:
        raise ValueError("decode needs block_h >= 16 (the rows of a tl.dot tile)")
    return launch_mla_paged(
        q, latent_cache, latent_scale, kv_lora_rank, seq_lens, page_table, expected_tags, page_tags,
        tag_mismatch, softmax_scale, topk_indices, None, num_splits=num_splits, check_tags=check_tags,
        block_h=block_h, block_n=block_n, num_warps=num_warps, num_stages=num_stages, masked_loads=masked_loads,
    )  # fmt: skip


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
    from kernels.mla_attention import mla_attention_ref

    query_start = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
    return mla_attention_ref(
        q, latent_cache, latent_scale, kv_lora_rank, query_start, seq_lens, page_table,
        expected_tags, page_tags, tag_mismatch, softmax_scale, topk_indices,
    )  # fmt: skip

"""DSA indexer on the GPU: Triton scoring over the paged indexer keys, tag-checked, then `torch.topk`.

Same inputs and output as `dsa_indexer_ref` (`kernels/dsa_indexer.py`, the CPU path and this op's
reference): `score[t, j] = Σ_h w[t, h] · relu(q[t, h] · k[j] · softmax_scale · k_scale)` for every
token j query t may see, and the `topk` best positions per query (-1 where fewer are visible).

Scoring (`_dsa_scores_kernel`, grid `(token blocks, query tiles)`): a program takes BLOCK_N tokens
of one sequence and a tile of BLOCK_Q consecutive queries of it (`mla_prefill.query_tiles`; decode:
one query); the rows of its one `tl.dot` are (query, indexer head) pairs, so each key tile is loaded
once for all heads and queries of the tile; relu, the per-head weight and the sum over heads follow
in registers. It writes a full row block of an fp32 score buffer `[NT · BLOCK_Q, Mp · S]`: -inf for a
token the row may not see (after its query, past the sequence, on a page that failed its check, or
a row past the tile's queries), so `torch.topk` over the buffer needs no other mask and the buffer
needs no fill. Token blocks past a tile's last visible token read nothing.

Selection: `torch.topk` (sorted, as the reference) over each row, -inf picks → -1, rows scattered to
their queries (idle rows to a spare row). GLM-5 asks for 2048 of up to ~200k tokens; a Triton radix
top-k could avoid the score buffer's round trip through HBM, if the H200 benchmark says topk
dominates. The buffer is bounded by `max_score_bytes` (long prefill chunks go in groups of tiles),
and everything is sized on the host from T, B and the page table's width: no host sync, so a step
can be captured in a CUDA graph.

Tag check, fused: a program checks the page of each token it may read; a mismatch flags the sequence
and its tokens get -inf (never chosen), whatever their bytes (another tenant's NaN included). The
sequence's last tile covers every page in use, so the flag matches the reference's, except that a
sequence with no new token gets no program (as in `mla_prefill`). FP8 keys are converted to fp16
for the dot (e4m3 -> fp16 is one cvt) and `k_scale` folds into the score scale.

Shapes: T queries, B sequences, Hi indexer heads, Di indexer head dim, P pages, S page size,
Mp pages per sequence in the table, W = Mp · S, NT query tiles, K top-k.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.dsa_indexer import dsa_indexer_ref
from kernels.mla_decode import QueryTiles, query_tile
from kernels.mla_prefill import query_tiles
from kernels.split_k_merge import TL_DTYPES

__all__ = ["dsa_indexer", "dsa_indexer_ref", "dsa_indexer_scores"]


@triton.jit
def _dsa_scores_kernel(
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


def indexer_tiles(
    query_start: torch.Tensor, num_tokens: int, num_seqs: int, num_heads: int, block_q: int | None = None
) -> QueryTiles:
    """The scoring grid's query tiles; `block_q` default: 1 where T <= B (decode), else 64 dot rows' worth."""
    if block_q is None:
        block_q = 1 if num_tokens <= num_seqs else max(1, 64 // triton.next_power_of_2(num_heads))
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError("block_q must be a power of two")
    return query_tiles(query_start, num_tokens, block_q)


def dsa_indexer_scores(
    q: torch.Tensor,  # [T, Hi, Di] fp16 / bf16 / fp32
    weights: torch.Tensor,  # [T, Hi] float32
    k_cache: torch.Tensor,  # [P, S, Di] q's dtype or float8_e4m3fn
    k_scale: float,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, set (never cleared) where a page's tag is wrong
    softmax_scale: float,
    *,
    tiles: QueryTiles | None = None,  # None: indexer_tiles' default
    tiles_range: tuple[int, int] | None = None,  # (first, end) tiles of this launch; None: all
    block_n: int = 64,
    num_warps: int = 8,
    check_tags: bool = True,
    out: torch.Tensor | None = None,  # [NTc · BQ, W] fp32, written whole
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [NTc · BQ, W] fp32, the query row of each score row [NTc · BQ] int64, T = none)."""
    T, Hi, Di = q.shape
    B = seq_lens.shape[0]
    W = page_table.shape[1] * k_cache.shape[1]
    check_indexer_inputs(q, weights, k_cache, query_start, seq_lens, page_table, expected_tags, tag_mismatch)
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_n must be a power of two >= 16")
    tiles = tiles or indexer_tiles(query_start, T, B, Hi)
    block_q = tiles.block_q
    t0, t1 = tiles_range or (0, tiles.tile_seq.shape[0])
    rows = (t1 - t0) * block_q
    if out is None:
        out = torch.empty((rows, W), dtype=torch.float32, device=q.device)
    elif out.shape != (rows, W) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {W}] float32 with unit-stride rows")
    # the query row of each score row; rows past a tile's queries (and idle tiles) map to T
    seq = tiles.tile_seq[t0:t1].long()
    ends = tiles.query_start.long()[(seq + 1).clamp(max=B)]
    q_row = tiles.tile_q0[t0:t1].long()[:, None] + torch.arange(block_q, device=q.device)  # [NTc, BQ]
    q_row = torch.where((seq[:, None] < B) & (q_row < ends[:, None]), q_row, T).flatten()
    if rows == 0 or W == 0:
        return out, q_row
    _dsa_scores_kernel[(triton.cdiv(W, block_n), t1 - t0)](
        q,
        weights,
        k_cache,
        page_table,
        expected_tags,
        page_tags,
        seq_lens,
        tiles.query_start,
        tiles.tile_seq,
        tiles.tile_q0,
        tag_mismatch.view(torch.uint8),
        out,
        softmax_scale * k_scale,
        t0,
        B,
        Hi,
        Di,
        W,
        q.stride(0),
        q.stride(1),
        weights.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        page_table.stride(0),
        expected_tags.stride(0),
        out.stride(0),
        PAGE_SIZE=k_cache.shape[1],
        BLOCK_Q=block_q,
        BLOCK_H=max(triton.next_power_of_2(Hi), 16 // block_q),  # a tl.dot tile has at least 16 rows
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(Di)),
        CHECK_TAGS=check_tags,
        COMPUTE=tl.float16 if k_cache.dtype == torch.float8_e4m3fn else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return out, q_row


def dsa_indexer(
    q: torch.Tensor,  # [T, Hi, Di] rotated indexer queries, fp16 / bf16 / fp32
    weights: torch.Tensor,  # [T, Hi] float32 per-head weights
    k_cache: torch.Tensor,  # [P, S, Di] indexer keys, q's dtype or float8_e4m3fn
    k_scale: float,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, set (never cleared) where a page's tag is wrong
    softmax_scale: float,
    topk: int,
    *,
    check_tags: bool = True,  # False only to measure the check's cost
    block_q: int | None = None,
    block_n: int = 64,
    num_warps: int = 8,
    max_score_bytes: int = 2**30,  # the score buffer's bound: long chunks go in groups of tiles
) -> torch.Tensor:  # [T, K] int64 positions, best first, -1 padded
    """`dsa_indexer_ref` on the GPU; see the module docstring.

    Tile defaults: 1 query (decode) or 2 queries (GLM-5's 32 heads: 64 dot rows) × 64 tokens on 8 warps,
    the shapes ptxas compiles for sm90 without spills (`python -m tests.kernels.sm90_compile`; 4 warps,
    or 32 head rows as the dot's M, spill); not yet measured.
    """
    T, Hi, _ = q.shape
    W = page_table.shape[1] * k_cache.shape[1]
    check_indexer_inputs(q, weights, k_cache, query_start, seq_lens, page_table, expected_tags, tag_mismatch)
    out = torch.full((T + 1, topk), -1, dtype=torch.int64, device=q.device)  # row T: idle score rows
    k_eff = min(topk, W)
    if T == 0 or k_eff == 0:
        return out[:T]
    tiles = indexer_tiles(query_start, T, seq_lens.shape[0], Hi, block_q)
    num_tiles = tiles.tile_seq.shape[0]
    group = max(1, max_score_bytes // (4 * W * tiles.block_q))  # tiles per launch
    for t0 in range(0, num_tiles, group):
        scores, q_row = dsa_indexer_scores(
            q, weights, k_cache, k_scale, query_start, seq_lens, page_table, expected_tags, page_tags,
            tag_mismatch, softmax_scale, tiles=tiles, tiles_range=(t0, min(t0 + group, num_tiles)),
            block_n=block_n, num_warps=num_warps, check_tags=check_tags,
        )  # fmt: skip
        top = scores.topk(k_eff, dim=1)  # [rows, K'] sorted, as the reference
        out[q_row, :k_eff] = torch.where(torch.isinf(top.values), -1, top.indices)
    return out[:T]


def check_indexer_inputs(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    tag_mismatch: torch.Tensor,
) -> None:
    """Shapes, dtypes and strides the scoring kernel needs; raises on the first misfit."""
    if q.dim() != 3 or k_cache.dim() != 3 or k_cache.shape[2] != q.shape[2]:
        raise ValueError(
            f"q [T, Hi, Di] {tuple(q.shape)} and k_cache [P, S, Di] {tuple(k_cache.shape)} do not fit"
        )
    T, Hi, _ = q.shape
    B = seq_lens.shape[0]
    if q.dtype not in TL_DTYPES or k_cache.dtype not in (q.dtype, torch.float8_e4m3fn):
        raise TypeError(
            f"q fp16/bf16/fp32 and keys of q's dtype or float8_e4m3fn, got {q.dtype}/{k_cache.dtype}"
        )
    if weights.shape != (T, Hi) or weights.dtype != torch.float32:
        raise ValueError(
            f"weights must be float32 [T, Hi] = [{T}, {Hi}], got {weights.dtype} {tuple(weights.shape)}"
        )
    if query_start.shape != (B + 1,) or page_table.shape[0] != B or expected_tags.shape != page_table.shape:
        raise ValueError("query_start [B+1], seq_lens [B], page_table and expected_tags [B, Mp] must agree")
    if page_table.dtype != torch.int32 or expected_tags.dtype != torch.int64:
        raise TypeError("page_table must be int32, expected_tags int64")
    if tag_mismatch.shape != (B,) or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or weights.stride(1) != 1:
        raise ValueError("the last dimension of q, weights and k_cache must be contiguous")
    if page_table.stride(1) != 1 or expected_tags.stride(1) != 1:
        raise ValueError("page_table and expected_tags rows must be contiguous")

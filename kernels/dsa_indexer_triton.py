"""DSA indexer on the GPU: Triton scoring over the paged indexer keys, tag-checked, then `torch.topk`.

Same inputs and output as `dsa_indexer_ref` (`kernels/dsa_indexer.py`, the CPU path and this op's
reference): `score[t, j] = Σ_h w[t, h] · relu(q[t, h] · k[j] · softmax_scale · k_scale)` for every
token j query t may see, and the `topk` best positions per query (-1 where fewer are visible).

Scoring (`_dsa_scores_kernel`, grid `(key blocks, query tiles)`): a program takes STEPS tiles of
BLOCK_N tokens of one sequence and a tile of BLOCK_Q consecutive queries of it (`mla_prefill.query_tiles`;
decode: one query); q and the head weights are loaded once for all its tiles, and the page ids two
tiles ahead and the keys one tile ahead are loaded by hand while a tile is scored (the keys go to
registers as the dot's operand, which Triton's pipeliner does not stage). The rows of its one `tl.dot`
are (query, indexer head) pairs, so each key tile is loaded once for all heads and queries of the
tile; relu, the per-head weight (`softmax_scale · k_scale` folded into it) and the sum over heads
follow in registers. It writes a full row block of an fp32 score buffer `[NT · BLOCK_Q, Mp · S]`:
-inf for a token the row may not see (after its query, past the sequence, on a page that failed its
check, or a row past the tile's queries), so `torch.topk` over the buffer needs no other mask and the
buffer needs no fill. Tiles past a tile's last visible token read nothing.

Selection: the reference's `top_positions` over each row (equal scores to the earlier token, -inf
picks → -1) as a set, unsorted (`top_positions_triton`, kernels/selection_triton.py): on CUDA a radix
select, one program a row, for rows up to RADIX_MAX_COLS (16,384) columns; past them the reference's
int64 keys and `topk` (which the buffer's bound counts: SELECT_BYTES); no selection at all where the row
has no more columns than k; rows scattered to their queries (idle rows to a spare row). GLM-5 asks for
2048 of up to ~200k tokens, and a decode graph's rows are the table's full width (the longest context
admitted), so a long-context engine still selects with `topk` (`benchmarks/kernels/bench_selection.py`).
The buffer is bounded by `max_score_bytes` (long chunks go in groups of tiles), and
everything is sized on the host from T, B and the page table's width: no host sync, so a step can
be captured in a CUDA graph.

Tag check, fused. Decode: per page and out of the token loop: a program loads the ids and expected tags of
its pages (those holding one of its visible tokens) beside its first page ids, gathers their tags
beside its first keys (from L2: back before the keys), and carries one scalar, its count of bad pages,
through the loop; the token loop is the unchecked kernel's. Only a program with a bad page (its
sequence is about to be aborted) flags the sequence (a plain store, no atomic) and, after a barrier,
re-walks its tiles to put -inf over the bad page's tokens whatever the loop wrote (another tenant's
NaN included), so they are never chosen; that rewrite must cover every token of its range the loop
scored (issue 27: `test_decode_rewrite_covers_every_score_the_token_loop_wrote` pins it).
(Before, each token's tag and expected tag were loaded a tile ahead in the loop, 2 x 64 int64 a tile and two registers' worth of pipeline: +8.3% at decode 128k on
the H200, 2026-12-02; the kernel before masked every key load with its token's tag, and the next one
compared and stored per tile, +6% to +32%.) Prefill keeps the per-token check in the loop (each token's
tag and expected tag a tile ahead, the flag stored once after the loop): per page, ptxas's hot loop grew
and one program fewer fit an SM, +15.6% against +6.9% (H200, 2026-12-02; decode per page +3.0% at 128k,
+1.9% at 8k). The sequence's last tile covers every page in use, so
the flag matches the reference's, except that a sequence with no new token gets no program (as in
`mla_prefill`).

FP8 keys are converted to fp16 for the dot (e4m3 -> fp16 is one cvt). Key tiles come from
`INDEXER_TILES` by name.

Shapes: T queries, B sequences, Hi indexer heads, Di indexer head dim, P pages, S page size,
Mp pages per sequence in the table, W = Mp · S, NT query tiles, K top-k.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.paged_gather import check_tag_inputs
from kernels.selection_triton import top_positions_triton
from kernels.split_k_merge import TL_DTYPES
from kernels.triton_lib import QueryTiles, pdl_args, pdl_enter, query_tile, query_tiles

__all__ = ["dsa_indexer_scores", "dsa_indexer_triton"]


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
    TAGS_PER_PAGE: tl.constexpr,  # with CHECK_TAGS: per page out of the token loop (decode), else per token in it
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 keys, else q's
    DOT_PRECISION: tl.constexpr,
    STEPS: tl.constexpr,  # key tiles per program (q and w are loaded once for all)
    TAG_PAGES: tl.constexpr,  # a power of two >= the pages a program's tokens can touch
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    pdl_enter(PDL)
    nb = tl.program_id(0)
    local = tl.program_id(1)
    tile = tile_base + local
    b, tile_ok, q0, num_q, L, first_pos, _ = query_tile(
        tile_seq_ptr, tile_q0_ptr, query_start_ptr, seq_lens_ptr, tile, num_seqs, BLOCK_Q
    )
    num_items = tl.where(tile_ok, first_pos + num_q, 0)  # tokens the tile's last query sees
    lo = nb * (BLOCK_N * STEPS)  # this program's tokens: [lo, hi)
    hi = tl.minimum(lo + BLOCK_N * STEPS, W)
    qr = tl.arange(0, BLOCK_Q)  # [BQ] query of the tile
    j = tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_Q * BLOCK_H)
    qi = rows // BLOCK_H
    h = rows % BLOCK_H
    row_ok = (qi < num_q) & (h < num_heads) & (lo < num_items)  # nothing to score: no load
    t_row = (q0 + qi).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < DI
    q = tl.load(
        q_ptr + t_row[:, None] * stride_qt + h[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :],
        other=0.0,
    ).to(COMPUTE)  # [BM, Di], loaded once for STEPS key tiles
    w = (
        tl.load(w_ptr + t_row * stride_wt + h, mask=row_ok, other=0.0) * qk_scale
    )  # [BM]; relu(x·c) = c·relu(x)
    out_row = (local * BLOCK_Q + qr).to(tl.int64)
    seen_hi = tl.minimum(hi, num_items)
    # by hand, a two-deep pipeline: the page ids two tiles ahead, the keys one tile ahead (the keys go to
    # registers as the dot's A operand, so Triton's pipeliner, which stages through shared memory, skips them)
    page = page_ids(page_table_ptr, b, stride_ptb, lo, j, seen_hi, PAGE_SIZE, BLOCK_N)
    # the tag check, per page and out of the token loop: the program's pages (every page holding one of
    # its visible tokens), their ids and expected tags loaded beside the first page ids, the tags they
    # carry gathered beside the first keys
    # (prefill keeps the per-token check in the loop: per page there, ptxas's hot loop grew from 565 to 630
    # instructions and 2 programs fit an SM instead of 3, +15.6% against +6.8% on the H200, 2026-12-02)
    p = lo // PAGE_SIZE + tl.arange(0, TAG_PAGES)
    p_ok = p < tl.cdiv(seen_hi, PAGE_SIZE)  # seen_hi <= lo: none
    if CHECK_TAGS and TAGS_PER_PAGE:
        page_p = tl.load(page_table_ptr + b * stride_ptb + p, mask=p_ok, other=0)
        expected_p = tl.load(expected_ptr + b * stride_etb + p, mask=p_ok, other=0)
    k_next = key_tile(k_ptr, page, lo, j, offs_d, d_ok, seen_hi, stride_kp, stride_ks, PAGE_SIZE, BLOCK_N)
    if (
        CHECK_TAGS and TAGS_PER_PAGE
    ):  # a scalar through the loop (the gather, from L2, is back before the keys)
        found_p = tl.load(page_tags_ptr + page_p, mask=p_ok, other=0)
        num_bad = tl.sum((p_ok & (found_p != expected_p)).to(tl.int32), axis=0)
    # per token (prefill): the tags a tile ahead, beside the next keys; only the select waits for them
    found_next, expected_next = tag_tile(page_tags_ptr, expected_ptr, page, b, stride_etb, lo, j, seen_hi,
                                         PAGE_SIZE, BLOCK_N, CHECK_TAGS and not TAGS_PER_PAGE)  # fmt: skip
    any_bad = tl.zeros([BLOCK_N], dtype=tl.int32)  # per token: the flag is stored once, after the loop
    page_next = page_ids(page_table_ptr, b, stride_ptb, lo + BLOCK_N, j, seen_hi, PAGE_SIZE, BLOCK_N)
    for n0 in range(lo, seen_hi, BLOCK_N):
        n = n0 + j  # [BN] token positions
        n_ok = n < num_items
        k = k_next
        k_next = key_tile(
            k_ptr, page_next, n0 + BLOCK_N, j, offs_d, d_ok, seen_hi, stride_kp, stride_ks, PAGE_SIZE, BLOCK_N
        )
        found, expected = found_next, expected_next
        found_next, expected_next = tag_tile(page_tags_ptr, expected_ptr, page_next, b, stride_etb, n0 + BLOCK_N,
                                             j, seen_hi, PAGE_SIZE, BLOCK_N, CHECK_TAGS and not TAGS_PER_PAGE)  # fmt: skip
        page = page_next
        page_next = page_ids(page_table_ptr, b, stride_ptb, n0 + 2 * BLOCK_N, j, seen_hi, PAGE_SIZE, BLOCK_N)
        if BLOCK_Q == 1:  # decode: tokens as the dot's rows (32 head rows spill registers on sm90)
            st = tl.dot(k.to(COMPUTE), tl.trans(q), input_precision=DOT_PRECISION)  # [BN, BM]
            per_query = tl.sum(tl.maximum(st, 0.0) * w[None, :], axis=1)[None, :]  # [1, BN]
        else:
            s = tl.dot(q, tl.trans(k.to(COMPUTE)), input_precision=DOT_PRECISION)  # [BM, BN]
            s = tl.maximum(s, 0.0) * w[:, None]
            per_query = tl.sum(tl.reshape(s, (BLOCK_Q, BLOCK_H, BLOCK_N)), axis=1)  # [BQ, BN]
        limit = first_pos + qr + 1  # [BQ] causal
        seen = n_ok[None, :] & (n[None, :] < limit[:, None]) & (qr < num_q)[:, None]
        if CHECK_TAGS and not TAGS_PER_PAGE:
            bad = n_ok & (found != expected)  # masked tokens read 0 on both sides
            any_bad = any_bad | bad.to(tl.int32)
            seen = seen & ~bad[None, :]
        sc = tl.where(seen, per_query, float("-inf"))  # a bad page's NaN bytes never pass
        tl.store(scores_ptr + out_row[:, None] * stride_st + n[None, :], sc, mask=(n < W)[None, :])
    if CHECK_TAGS and not TAGS_PER_PAGE:
        tl.store(mismatch_ptr + b, 1, mask=tl.max(any_bad, axis=0) > 0)
    if CHECK_TAGS and TAGS_PER_PAGE:  # noqa: SIM102 (num_bad exists only under the constexpr)
        if num_bad > 0:  # rare (the sequence is about to be aborted): flag it, then -inf over a bad page's
            # tokens, whatever the token loop wrote there (its bytes may be another tenant's NaN)
            tl.store(mismatch_ptr + b, 1)
            tl.debug_barrier()  # the token loop's stores of these scores (other threads') land first
            for n0 in range(lo, seen_hi, BLOCK_N):
                n = n0 + j
                page = page_ids(page_table_ptr, b, stride_ptb, n0, j, seen_hi, PAGE_SIZE, BLOCK_N)
                found, expected = tag_tile(page_tags_ptr, expected_ptr, page, b, stride_etb, n0, j, seen_hi,
                                           PAGE_SIZE, BLOCK_N, True)  # fmt: skip
                tl.store(
                    scores_ptr + out_row[:, None] * stride_st + n[None, :],
                    tl.full((BLOCK_Q, BLOCK_N), float("-inf"), dtype=tl.float32),
                    mask=((n < seen_hi) & (found != expected))[None, :],
                )
    past = lo + tl.cdiv(tl.maximum(seen_hi - lo, 0), BLOCK_N) * BLOCK_N
    for n0 in range(past, hi, BLOCK_N):  # tiles no query of the tile sees
        n = n0 + j
        tl.store(
            scores_ptr + out_row[:, None] * stride_st + n[None, :],
            tl.full((BLOCK_Q, BLOCK_N), float("-inf"), dtype=tl.float32),
            mask=(n < W)[None, :],
        )


@triton.jit
def page_ids(page_table_ptr, b, stride_ptb, n0, j, limit, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """[BN] int32: the page of token n0 + j (0 at or past `limit`)."""
    n = n0 + j
    page_idx = n0 // PAGE_SIZE + j // PAGE_SIZE if BLOCK_N % PAGE_SIZE == 0 else n // PAGE_SIZE
    return tl.load(page_table_ptr + b * stride_ptb + page_idx, mask=n < limit, other=0)


@triton.jit
def key_tile(
    k_ptr,
    page,
    n0,
    j,
    offs_d,
    d_ok,
    limit,
    stride_kp,
    stride_ks,
    PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """[BN, BD] the keys of tokens n0 + j on pages `page` (0 at or past `limit`)."""
    n = n0 + j
    in_page = j % PAGE_SIZE if BLOCK_N % PAGE_SIZE == 0 else n % PAGE_SIZE  # n0 starts a page, or not
    slot = page.to(tl.int64) * stride_kp + in_page * stride_ks
    return tl.load(
        k_ptr + slot[:, None] + offs_d[None, :], mask=(n < limit)[:, None] & d_ok[None, :], other=0.0
    )


@triton.jit
def tag_tile(
    page_tags_ptr, expected_ptr, page, b, stride_etb, n0, j, limit, PAGE_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, LOAD: tl.constexpr,
):  # fmt: skip
    """([BN] found, [BN] expected) int64 tags of tokens n0 + j on pages `page` (0 and 0 at or past
    `limit`; nothing loaded without LOAD): the page's tag now and the one the request holds."""
    if LOAD:
        n = n0 + j
        page_idx = n0 // PAGE_SIZE + j // PAGE_SIZE if BLOCK_N % PAGE_SIZE == 0 else n // PAGE_SIZE
        found = tl.load(page_tags_ptr + page, mask=n < limit, other=0)
        expected = tl.load(expected_ptr + b * stride_etb + page_idx, mask=n < limit, other=0)
    else:
        found = tl.zeros([BLOCK_N], dtype=tl.int64)
        expected = tl.zeros([BLOCK_N], dtype=tl.int64)
    return found, expected


def tag_pages(span: int, page_size: int) -> int:
    """A power of two >= the pages `span` tokens from a multiple of `span` can touch (the tag check's
    vector: one lane a page)."""
    pages = span // page_size if span % page_size == 0 else triton.cdiv(span - 1, page_size) + 1
    return max(2, triton.next_power_of_2(pages))


# bytes a score holds while it is selected by keys + topk: fp32 score, int32 bits, int64 key (the radix
# path, rows up to RADIX_MAX_COLS on CUDA, holds only the score; the bound keeps the larger)
SELECT_BYTES = 16


@dataclass(frozen=True, slots=True)
class IndexerTiles:
    """One launch configuration of the scoring kernel (an entry of INDEXER_TILES)."""

    block_n: int  # keys per tile
    steps: int = 1  # key tiles per program
    num_warps: int = 8
    num_stages: int = 2


# Named configurations "keys/phase/name"; DEFAULT_TILES picks one per (key dtype, phase).
INDEXER_TILES: dict[str, IndexerTiles] = {
    "bf16/decode/v4": IndexerTiles(block_n=64, steps=8, num_warps=4),  # 4 programs per SM
    "bf16/decode/v4-w8": IndexerTiles(block_n=64, steps=8),
    "fp8/decode/v4": IndexerTiles(block_n=64, steps=8, num_warps=4),  # 4 programs per SM
    "fp8/decode/v4-w8": IndexerTiles(block_n=64, steps=8),  # 2 programs per SM
    "fp8/decode/v4-n128": IndexerTiles(block_n=128, steps=4),
    "fp8/decode/v4-s1": IndexerTiles(block_n=64, steps=1),
    "bf16/prefill/v4": IndexerTiles(block_n=64, steps=4),
    "fp8/prefill/v4": IndexerTiles(block_n=64, steps=4, num_warps=4),  # 2 programs per SM
    "fp8/prefill/v4-w8": IndexerTiles(block_n=64, steps=4),
    "fp8/prefill/v4-n128": IndexerTiles(block_n=128, steps=2),
}
DEFAULT_TILES = {  # switch after the H200 run
    ("bf16", "decode"): "bf16/decode/v4",
    ("fp8", "decode"): "fp8/decode/v4",
    ("bf16", "prefill"): "bf16/prefill/v4",
    ("fp8", "prefill"): "fp8/prefill/v4",
}


def indexer_config(name: str | None, key_dtype: torch.dtype, prefill: bool) -> IndexerTiles:
    """The table entry `name`, or the default for the key dtype (16-bit keys share the bf16 rows) and phase."""
    kind = "fp8" if key_dtype == torch.float8_e4m3fn else "bf16"
    return INDEXER_TILES[name or DEFAULT_TILES[(kind, "prefill" if prefill else "decode")]]


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
    config: str | IndexerTiles | None = None,  # an INDEXER_TILES name or entry; None: the default
    check_tags: bool = True,
    out: torch.Tensor | None = None,  # [NTc · BQ, W] fp32, written whole
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scores [NTc · BQ, W] fp32, the query row of each score row [NTc · BQ] int64, T = none)."""
    T, Hi, Di = q.shape
    B = seq_lens.shape[0]
    W = page_table.shape[1] * k_cache.shape[1]
    check_indexer_inputs(
        q, weights, k_cache, query_start, seq_lens, page_table, expected_tags, page_tags, tag_mismatch
    )
    tiles = tiles or indexer_tiles(query_start, T, B, Hi)
    block_q = tiles.block_q
    cfg = config if isinstance(config, IndexerTiles) else indexer_config(config, k_cache.dtype, block_q > 1)
    if cfg.block_n < 16 or cfg.block_n & (cfg.block_n - 1):
        raise ValueError("block_n must be a power of two >= 16")
    t0, t1 = tiles_range or (0, tiles.tile_seq.shape[0])
    rows = (t1 - t0) * block_q
    if out is None:
        out = torch.empty((rows, W), dtype=torch.float32, device=q.device)
    elif out.shape != (rows, W) or out.dtype != torch.float32 or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {W}] float32 with unit-stride rows")
    # the query row of each score row; rows past a tile's queries (and idle tiles) map to T
    if is_query_per_tile(tiles, T):  # decode: score row i is query t0 + i (tile_q0 is 0..T-1: no launch)
        q_row = tiles.tile_q0[t0:t1]
    else:
        seq = tiles.tile_seq[t0:t1].long()
        ends = tiles.query_start.long()[(seq + 1).clamp(max=B)]
        q_row = tiles.tile_q0[t0:t1].long()[:, None] + torch.arange(block_q, device=q.device)  # [NTc, BQ]
        q_row = torch.where((seq[:, None] < B) & (q_row < ends[:, None]), q_row, T).flatten()
    if rows == 0 or W == 0:
        return out, q_row
    _dsa_scores_kernel[(triton.cdiv(W, cfg.block_n * cfg.steps), t1 - t0)](
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
        BLOCK_N=cfg.block_n,
        BLOCK_D=max(16, triton.next_power_of_2(Di)),
        CHECK_TAGS=check_tags,
        TAGS_PER_PAGE=block_q == 1,  # decode; prefill per token (see the kernel)
        COMPUTE=tl.float16 if k_cache.dtype == torch.float8_e4m3fn else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        STEPS=cfg.steps,
        TAG_PAGES=tag_pages(cfg.block_n * cfg.steps, k_cache.shape[1]),
        **pdl_args(q.device),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out, q_row


def dsa_indexer_triton(
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
    config: str | IndexerTiles | None = None,  # an INDEXER_TILES name or entry; None: the default
    max_score_bytes: int = 2**30,  # the selection's bound (scores + keys): long chunks go in groups of tiles
    tiles: QueryTiles | None = None,  # `indexer_tiles` of these queries, made once a step (the entry's memo)
) -> torch.Tensor:  # [T, K] int64 positions, in no particular order, -1 padded
    """`dsa_indexer_ref`'s choice (as a set) on the GPU; see the module docstring. Query tiles: 1
    query (decode) or 2 (GLM-5's 32 heads: 64 dot rows); key tiles from INDEXER_TILES."""
    T, Hi, _ = q.shape
    W = page_table.shape[1] * k_cache.shape[1]
    check_indexer_inputs(
        q, weights, k_cache, query_start, seq_lens, page_table, expected_tags, page_tags, tag_mismatch
    )
    k_eff = min(topk, W)
    if T == 0 or k_eff == 0:
        return torch.full((T, topk), -1, dtype=torch.int64, device=q.device)
    tiles = tiles or indexer_tiles(query_start, T, seq_lens.shape[0], Hi, block_q)
    num_tiles = tiles.tile_seq.shape[0]
    group = max(1, max_score_bytes // (SELECT_BYTES * W * tiles.block_q))  # tiles per launch
    if is_query_per_tile(tiles, T) and group >= num_tiles:  # decode: one launch, rows in query order
        scores, _ = dsa_indexer_scores(
            q, weights, k_cache, k_scale, query_start, seq_lens, page_table, expected_tags, page_tags,
            tag_mismatch, softmax_scale, tiles=tiles, config=config, check_tags=check_tags,
        )  # fmt: skip
        chosen = top_positions_triton(scores, k_eff)  # [T, K'] the reference's choice, unsorted
        return chosen if k_eff == topk else torch.nn.functional.pad(chosen, (0, topk - k_eff), value=-1)
    out = torch.full((T + 1, topk), -1, dtype=torch.int64, device=q.device)  # row T: idle score rows
    for t0 in range(0, num_tiles, group):
        scores, q_row = dsa_indexer_scores(
            q, weights, k_cache, k_scale, query_start, seq_lens, page_table, expected_tags, page_tags,
            tag_mismatch, softmax_scale, tiles=tiles, tiles_range=(t0, min(t0 + group, num_tiles)),
            config=config, check_tags=check_tags,
        )  # fmt: skip
        # the reference's choice, unsorted: sparse MLA takes it as a set (the sort was 45% of the
        # selection's time at 2k tokens on the H200, 2026-12-04)
        out[q_row, :k_eff] = top_positions_triton(scores, k_eff)  # [rows, K']
    return out[:T]


def is_query_per_tile(tiles: QueryTiles, num_tokens: int) -> bool:
    """Decode's tiles: one per query, tile t query t (`query_tiles` with block_q 1, every one of
    the T queries in query_start's ranges)."""
    return tiles.block_q == 1 and tiles.tile_q0.shape[0] == num_tokens


def check_indexer_inputs(
    q: torch.Tensor,
    weights: torch.Tensor,
    k_cache: torch.Tensor,
    query_start: torch.Tensor,
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    page_tags: torch.Tensor,
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
    check_tag_inputs(page_table, expected_tags, page_tags)
    if query_start.shape != (B + 1,) or page_table.shape[0] != B:
        raise ValueError("query_start [B+1], seq_lens [B], page_table and expected_tags [B, Mp] must agree")
    if tag_mismatch.shape != (B,) or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    if q.stride(2) != 1 or k_cache.stride(2) != 1 or weights.stride(1) != 1:
        raise ValueError("the last dimension of q, weights and k_cache must be contiguous")

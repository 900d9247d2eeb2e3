"""Paged MLA attention for prefill chunks: varlen queries, causal, attending to cached pages, tag-checked.

Same inputs and output as `mla_attention_ref` (any mix of sequences with one or many new tokens;
the new tokens' latents are already in the cache, so a chunk sees its cached prefix and itself).
The kernel is `mla_decode`'s (`kernels/mla_decode.py`, which documents the tag check, FP8 and the
split-K merge) with a tile of BLOCK_Q consecutive queries of one sequence × BLOCK_H heads per
program: all heads share the one latent line, so every row of the tile uses each loaded latent tile,
and row (query i, head h) masks the tokens after query i's position. The default tile has 64 rows,
the M of one wgmma warpgroup (1 query × 64 heads at Kimi's 64; 8 × 8 at a TP8 shard). Sparse mode
(DSA) gives each query its own top-k list, so its tiles hold one query (BLOCK_Q = 1) and BLOCK_H >= 16
heads.

The grid is built on the device (no host sync, graph-capturable): sequence b has
`ceil(q_len_b / BLOCK_Q)` tiles, and the grid size `min(T, ceil(T / BLOCK_Q) + B)` bounds their sum;
tiles past the sum are idle.

One difference from the reference: a sequence with no new token in the batch gets no program, so its
pages are not checked here (the reference checks every sequence's pages); the engine never
schedules such a sequence.

Shapes: T queries, B sequences, H heads, R kv_lora_rank, Dr rope dim, P pages, S page size, K top-k,
NT tiles.
"""

from __future__ import annotations

from typing import Any

import torch
import triton

from kernels.mla_decode import check_mla_inputs, launch_mla_paged
from kernels.mla_tiles import resolve_tiles, tile_rows
from kernels.triton_lib import memo_query_tiles

__all__ = ["mla_prefill"]


def mla_prefill(
    q: torch.Tensor,  # [T, H, R + Dr] fp16 / bf16 / fp32, absorbed
    latent_cache: torch.Tensor,  # [P, S, R + Dr] q's dtype or float8_e4m3fn
    latent_scale: float,
    kv_lora_rank: int,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache including this step's
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, set (never cleared) where a page's tag is wrong
    softmax_scale: float,
    topk_indices: torch.Tensor | None = None,  # [T, K] int32/int64 positions, -1 padded, no repeats
    *,
    num_splits: int | None = None,
    check_tags: bool = True,  # False only to measure the check's cost
    block_q: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    block_rc: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    fp8_dot: bool = False,
    memo: dict[Any, Any] | None = None,  # the step's (`PagedBatch.memo`): its query tiles made once
) -> torch.Tensor:  # [T, H, R] in q's dtype
    """`mla_attention_ref` on the GPU; see the module docstring.

    Tile defaults (None): 64 rows, the wgmma tile (1 query × 64 heads, 8 × 8 where H = 8, ...; sparse:
    1 × 64, or 1 × 16 where H <= 16), the rest `kernels.mla_tiles.TILES`' for that many rows
    (`fp8_dot` with an FP8 cache: `FP8_DOT_TILES`', e4m3 dots as `mla_decode`'s).
    """
    if q.dim() != 3:
        raise ValueError(f"q must be [T, H, R + Dr], got {tuple(q.shape)}")
    B, H = seq_lens.shape[0], q.shape[1]
    if query_start.shape != (B + 1,):
        raise ValueError(f"query_start must be [B+1] = [{B + 1}], got {tuple(query_start.shape)}")
    sparse = topk_indices is not None
    if sparse:  # one query per tile: each has its own list
        block_q, block_h = 1, max(16, block_h or tile_rows(H))
    block_h = block_h or min(64, triton.next_power_of_2(H))
    block_q = block_q or max(1, 64 // block_h)
    if block_q < 1 or block_q & (block_q - 1):
        raise ValueError("block_q must be a power of two")
    tiles = resolve_tiles(
        "sparse" if sparse else "prefill", block_q * block_h, latent_cache.dtype == torch.float8_e4m3fn,
        block_h, block_n, block_rc, num_warps, num_stages, fp8_dot=fp8_dot,
    )  # fmt: skip
    check_mla_inputs(
        q, latent_cache, kv_lora_rank, seq_lens, page_table, expected_tags, page_tags, tag_mismatch,
        topk_indices, tiles.block_h, tiles.block_n,
    )  # fmt: skip
    return launch_mla_paged(
        q, latent_cache, latent_scale, kv_lora_rank, seq_lens, page_table, expected_tags, page_tags,
        tag_mismatch, softmax_scale, topk_indices, memo_query_tiles(memo, query_start, q.shape[0], block_q),
        num_splits=num_splits, check_tags=check_tags, tiles=tiles,
    )  # fmt: skip

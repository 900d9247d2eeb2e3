"""Paged GQA attention for prefill chunks (varlen, causal, over cached pages), BF16 or FP8 KV, tag-checked.

Same inputs and output as `paged_attention_ref` (`kernels/paged_attention.py`, the CPU path and this
kernel's reference): each sequence's new queries are its last `q_len` tokens, already written to
the cache by `kv_write`, and attend causally to the cached prefix and themselves. Structure as in
`kernels/mla_prefill.py`: a program takes a tile of BLOCK_Q consecutive queries of one sequence
(`mla_prefill.query_tiles`, built on the device: no host sync, graph-capturable) for one KV head;
its rows are (query, query head of the group) pairs, `BLOCK_Q = BLOCK_M // G` queries in a power-of-two
BLOCK_M (GLM-4.5-Air: G = 12, 10 queries in 128 rows), so every K/V tile is loaded once and used by
two `tl.dot`s over all of them; row (query i, head h) masks the tokens after query i's position.

Split-K as in `paged_decode_gqa` (a long context with few queries, e.g. decode rows of a mixed step):
grid `(tiles, Hkv, splits)`, each program walks one slice of its tile's tokens with an online softmax
and writes the normalised partial output and its log-sum-exp; `kernels.split_k_merge` merges them.
With one slice the program writes the output itself. Tiles are the fastest grid axis so neighbouring
tiles of one sequence read the same pages side by side (L2 reuse).

Each program runs `kernels.gqa_slice.attend_slice`: the tiles every row of the tile sees go unmasked,
the diagonal ones causally masked. Page-tag check, in a second launch of the same kernel
(`CHECK_TAGS`): the first reads no tag at all, so its SASS is the unchecked kernel's (with the
re-walk compiled into it, as decode does it, ptxas chose other address arithmetic for the BF16 hot
loop, +5% on the H200); the second counts each slice's bad pages in one vectorised pass, returns at
once for a clean slice, and only a slice with a bad page sets `tag_mismatch[b]` and is walked again,
overwriting the first launch's part: its bad tokens at -inf with their K/V never read (the bytes may
be another tenant's NaN). The merge runs after both. The sequence's last tile covers every page in use, so the flag matches
the reference's — except that a sequence with no new token gets no program (as in `mla_prefill`; the
engine never schedules one). Both launches walk no token past a sequence's page-table row (the bound in
`kernels/triton_lib.py`). FP8: dots in fp16 (e4m3 -> fp16 is one cvt; V as byte pairs, see
`gqa_slice`), `k_scale` folded into the softmax scale and `v_scale` into the output. Tiles come from
`PREFILL_TILES` by name (`DEFAULT_TILES` per cache dtype). It replaced an earlier kernel, measured
1.9× faster on the H200 (2026-12-01).

Shapes: T queries, B sequences, Hq query heads, Hkv KV heads, G = Hq / Hkv, D head dim, Dv value dim,
P pages, S page size, Mp pages per sequence in the table, NT tiles, NS slices.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import triton
import triton.language as tl

from kernels.gqa_slice import (
    GQATiles,
    attend_checked,
    attend_slice,
    count_bad_pages,
    join_halves,
    slice_constexprs,
)
from kernels.paged_decode_gqa import check_gqa_inputs
from kernels.split_k_merge import TL_DTYPES, merge_splits, num_sms, pick_num_splits
from kernels.triton_lib import memo_query_tiles, query_tile

__all__ = ["paged_prefill_gqa"]


@triton.jit(do_not_specialize=["num_cols"])
def _paged_prefill_gqa_kernel(
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
    num_cols,  # the page table's width, Mp
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
    CHECK_TAGS: tl.constexpr,  # the check launch: count the slice's bad pages, redo (checked) only where any
    DIRECT: tl.constexpr,  # one slice: write the final output, skip the partials
    COMPUTE: tl.constexpr,  # dot operand dtype: fp16 for FP8 caches, else q's
    DOT_PRECISION: tl.constexpr,
    EVEN_D: tl.constexpr,  # D and Dv are powers of two (no column masks)
    SHARED_OFFSETS: tl.constexpr,  # K and V have the same strides
    SPLIT_V: tl.constexpr,  # FP8 V read as byte pairs (kernels/gqa_slice.py)
    LAZY_SUM: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX allowed (not in the interpreter)
):
    tile = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    b, tile_ok, q0, num_q, L, first_pos, _ = query_tile(
        tile_seq_ptr, tile_q0_ptr, query_start_ptr, seq_lens_ptr, tile, num_seqs, BLOCK_Q
    )
    # tokens the tile's last query sees, never past the row (the bound in `kernels/triton_lib.py`)
    num_items = tl.where(tile_ok, tl.minimum(first_pos + num_q, num_cols * PAGE_SIZE), 0)
    per_split = tl.cdiv(tl.cdiv(num_items, num_splits), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, num_items)
    if CHECK_TAGS:  # the second launch: a slice whose pages all carry their expected tags has nothing to redo
        num_bad = count_bad_pages(
            page_table_ptr, expected_ptr, page_tags_ptr, b, stride_ptb, stride_etb, start, end, PAGE_SIZE, BLOCK_P,
        )  # fmt: skip
        if num_bad == 0:
            return
        tl.store(mismatch_ptr + b, 1)

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
    row_limit = first_pos + qi + 1  # [BM] tokens the row's query may see (causal)
    if CHECK_TAGS:  # a cold path: its sequence is about to be aborted
        m, l, acc, acc2 = attend_checked(
            q, row_limit, first_pos + 1, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, b, kvh,
            start, end, qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_ptb, stride_etb, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, True, EVEN_D,
            SHARED_OFFSETS, SPLIT_V, LAZY_SUM, ASM, COMPUTE, DOT_PRECISION,
        )  # fmt: skip
        acc = join_halves(acc, acc2, BLOCK_M, BLOCK_DV, SPLIT_V)
    else:  # the first launch reads no tag at all: its SASS is the unchecked kernel's
        m, l, acc = attend_slice(
            q, row_limit, first_pos + 1, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, mismatch_ptr,
            b, kvh, start, end, qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
            stride_ptb, stride_etb, PAGE_SIZE, BLOCK_M, BLOCK_N, BLOCK_P, BLOCK_D, BLOCK_DV, False, True,
            EVEN_D, SHARED_OFFSETS, SPLIT_V, LAZY_SUM, ASM, COMPUTE, DOT_PRECISION,
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


# Named launch configurations; DEFAULT_TILES picks one per cache dtype.
PREFILL_TILES: dict[str, GQATiles] = {
    "bf16/v4": GQATiles(block_m=128, block_n=64, num_warps=8),
    "bf16/v4-n128": GQATiles(block_m=128, block_n=128, num_warps=8),
    "bf16/v4-m64": GQATiles(block_m=64, block_n=64, num_warps=4),
    "fp8/v4": GQATiles(block_m=128, block_n=64, num_warps=8, split_v=True),
    "fp8/v4-n128": GQATiles(block_m=128, block_n=128, num_warps=8, split_v=True),
}
# H200, 2026-12-01: bf16/v4-m64 took 0.91 / 0.80 of bf16/v4's time (8k prompt; 2k chunk after 30k)
DEFAULT_TILES = {"bf16": "bf16/v4-m64", "fp8": "fp8/v4"}


def prefill_tiles(name: str | None, cache_dtype: torch.dtype) -> GQATiles:
    """The table entry `name`, or the default for the cache dtype (16-bit caches share the bf16 rows)."""
    kind = "fp8" if cache_dtype == torch.float8_e4m3fn else "bf16"
    return PREFILL_TILES[name or DEFAULT_TILES[kind]]


def paged_prefill_gqa(
    q: torch.Tensor,  # [T, Hq, D] fp16 / bf16 / fp32
    k_cache: torch.Tensor,  # [P, S, Hkv, D] q's dtype or float8_e4m3fn
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    k_scale: float,
    v_scale: float,
    query_start: torch.Tensor,  # [B+1] int32
    seq_lens: torch.Tensor,  # [B] int32, tokens in the cache including this step's
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
    tag_mismatch: torch.Tensor,  # [B] bool, set (never cleared) where a page's tag is wrong
    softmax_scale: float,
    *,
    num_splits: int | None = None,
    check_tags: bool = True,  # False only to measure the check's cost
    tiles: str | GQATiles | None = None,  # a PREFILL_TILES name or entry; None: DEFAULT_TILES
    out: torch.Tensor | None = None,  # [T, Hq, Dv] q's dtype, written whole (a graph's static buffer)
    memo: dict[Any, Any] | None = None,  # the step's (`PagedBatch.memo`): its query tiles made once
) -> torch.Tensor:  # [T, Hq, Dv] in q's dtype
    """`paged_attention_ref` on the GPU; see the module docstring."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    T, Hq, D = q.shape
    B = seq_lens.shape[0]
    check_gqa_inputs(q, k_cache, v_cache, seq_lens, page_table, expected_tags, page_tags, tag_mismatch)
    if query_start.shape != (B + 1,):
        raise ValueError(f"query_start must be [B+1] = [{B + 1}], got {tuple(query_start.shape)}")
    Hkv, Dv = k_cache.shape[2], v_cache.shape[3]
    G = Hq // Hkv
    cfg = tiles if isinstance(tiles, GQATiles) else prefill_tiles(tiles, k_cache.dtype)
    block_m, block_n = max(cfg.block_m, 16, triton.next_power_of_2(G)), cfg.block_n
    if block_m & (block_m - 1) or block_n < 16 or block_n & (block_n - 1):
        raise ValueError("block_m and block_n must be powers of two, block_n >= 16 (tl.dot tiles)")
    if out is None:
        out = torch.empty((T, Hq, Dv), dtype=q.dtype, device=q.device)
    elif out.shape != (T, Hq, Dv) or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError(f"out must be [T, Hq, Dv] = {(T, Hq, Dv)} of {q.dtype}, unit-stride in Dv")
    if T == 0:
        return out
    block_q = block_m // G
    tiles = memo_query_tiles(memo, query_start, T, block_q)
    num_tiles = tiles.tile_seq.shape[0]
    S = k_cache.shape[1]
    splits = num_splits or pick_num_splits(num_tiles, Hkv, page_table.shape[1] * S, num_sms(q.device))
    direct = splits == 1
    if direct:
        part_o = part_lse = out  # not read: the kernel writes `out` itself
    else:
        part_o = torch.empty((T, Hq, splits, Dv), dtype=torch.float32, device=q.device)
        part_lse = torch.empty((T, Hq, splits), dtype=torch.float32, device=q.device)
    block_d = max(16, triton.next_power_of_2(D))
    block_dv = max(16, triton.next_power_of_2(Dv))
    launch = functools.partial(
        _paged_prefill_gqa_kernel[(num_tiles, Hkv, splits)],
        q,
        k_cache,
        v_cache,
        page_table,
        expected_tags,
        page_tags,
        seq_lens,
        tiles.query_start,
        tiles.tile_seq,
        tiles.tile_q0,
        tag_mismatch.view(torch.uint8),
        part_o,
        part_lse,
        out,
        softmax_scale * k_scale * math.log2(math.e),
        v_scale,
        B,
        splits,
        Hq,
        page_table.shape[1],
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
        out.stride(0),
        out.stride(1),
        PAGE_SIZE=S,
        GROUP=G,
        BLOCK_Q=block_q,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        DIRECT=direct,
        COMPUTE=tl.float16 if k_cache.dtype == torch.float8_e4m3fn else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **slice_constexprs(cfg, q, k_cache, v_cache, block_d, block_dv),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
    launch(CHECK_TAGS=False)  # every slice, no tag read
    if check_tags:  # then the check: slices holding a bad page flag their sequence and overwrite their part
        launch(CHECK_TAGS=True)
    if not direct:
        merge_splits(part_o, part_lse, out, v_scale)
    return out

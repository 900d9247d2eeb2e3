"""Paged decode attention for GQA (one new token per sequence), BF16 or FP8 e4m3 KV, tag-checked.

Split-K: stage 1 (`_paged_decode_gqa_kernel`, grid `(B, Hkv, splits)`) walks one slice of one
sequence's tokens for one KV head and all `G = Hq / Hkv` query heads that share it (one K/V load,
`tl.dot` over G rows padded to 16), with an online softmax (`kernels.gqa_slice.attend_slice`); it
writes the normalised partial output and its log-sum-exp. Stage 2 (`kernels.split_k_merge`, grid
`(B, Hq)`) merges the slices by LSE. The number of slices is chosen from batch, KV heads and the page
table's width (host-known, so the launch can be captured in a CUDA graph), never from a device read.

The page-tag check is fused (`attend_slice`): each page's tag is compared with the sequence's expected
tag; a mismatched page contributes nothing (-inf scores, its K/V never read: another tenant's FP8
bytes may even be NaN) and sets `tag_mismatch[b]` so the engine aborts the sequence. The hot loop
reads no tag: the slice's pages are checked in one vectorised pass after it, and only a slice with a
bad page is walked again. A sequence longer than its page-table row is walked over the row's pages
only (the bound in `kernels/triton_lib.py`). With an FP8 cache the dots run in fp16 (e4m3 -> fp16 is
a single unpack instruction). FP8 scales are per layer: `k_scale` folds into the softmax scale, `v_scale` into the merge.

Tiles come from `DECODE_TILES` by name (`DEFAULT_TILES` per cache dtype, to be switched after an
H200 run of `benchmarks/kernels/bench_paged_decode.py --quick`). It replaced the 2026-11-29 kernel,
measured 1.3-1.6× faster on the H200 (2026-12-01).

Shapes: B sequences, Hq query heads, Hkv KV heads, D head dim, Dv value dim, P pages, S page size,
Mp pages per sequence in the table.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.gqa_slice import GQATiles, attend_slice, slice_constexprs
from kernels.paged_gather import check_tag_inputs
from kernels.split_k_merge import TL_DTYPES, merge_splits, num_sms


@triton.jit(do_not_specialize=["num_cols"])
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
    num_cols,  # the page table's width, Mp
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
    EVEN_D: tl.constexpr,  # D and Dv are powers of two (no column masks)
    SHARED_OFFSETS: tl.constexpr,  # K and V have the same strides
    SPLIT_V: tl.constexpr,  # FP8 V read as byte pairs (kernels/gqa_slice.py)
    LAZY_SUM: tl.constexpr,
    ASM: tl.constexpr,  # inline PTX allowed (not in the interpreter)
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    L = tl.load(seq_lens_ptr + b)
    # never a token past the row (the bound in `kernels/triton_lib.py`)
    L = tl.minimum(L, num_cols * PAGE_SIZE)
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
    m, l, acc = attend_slice(
        q, 0, 0, k_ptr, v_ptr, page_table_ptr, expected_ptr, page_tags_ptr, mismatch_ptr, b, kvh, start, end,
        qk_scale, D, DV, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_ptb, stride_etb,
        PAGE_SIZE, BLOCK_H, BLOCK_N, BLOCK_P, BLOCK_D, BLOCK_DV, CHECK_TAGS, False, EVEN_D, SHARED_OFFSETS, SPLIT_V,
        LAZY_SUM, ASM, COMPUTE, DOT_PRECISION,
    )  # fmt: skip
    lse = tl.where(l > 0.0, m + tl.log2(tl.where(l > 0.0, l, 1.0)), float("-inf"))
    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]
    row = (b * tl.num_programs(1) * GROUP + heads) * num_splits + split  # [BH] index into [B, Hq, NS]
    tl.store(part_o_ptr + row[:, None] * DV + offs_dv[None, :], o, mask=h_ok[:, None] & dv_ok[None, :])
    tl.store(part_lse_ptr + row, lse, mask=h_ok)


# Named launch configurations; DEFAULT_TILES picks one per cache dtype.
DECODE_TILES: dict[str, GQATiles] = {
    "bf16/v4": GQATiles(block_n=32, lazy_sum=True, programs_per_sm=6, max_registers=80),
    "bf16/v4-n64": GQATiles(block_n=64, lazy_sum=True, programs_per_sm=5),
    "fp8/v4": GQATiles(block_n=128, split_v=True, programs_per_sm=4),
    "fp8/v4-r96": GQATiles(
        block_n=128, split_v=True, programs_per_sm=5, max_registers=96
    ),  # 2 values spilled
    "fp8/v4-n64": GQATiles(block_n=64, split_v=True, programs_per_sm=5),
    "fp8/v4-lazy": GQATiles(block_n=128, split_v=True, lazy_sum=True, programs_per_sm=4),
}
DEFAULT_TILES = {"bf16": "bf16/v4", "fp8": "fp8/v4"}  # switch after the H200 run


def decode_tiles(name: str | None, cache_dtype: torch.dtype) -> GQATiles:
    """The table entry `name`, or the default for the cache dtype (16-bit caches share the bf16 rows)."""
    kind = "fp8" if cache_dtype == torch.float8_e4m3fn else "bf16"
    return DECODE_TILES[name or DEFAULT_TILES[kind]]


def pick_num_splits(
    batch: int,
    num_kv_heads: int,
    max_tokens: int,
    num_sms: int,
    programs_per_sm: int | None = None,
    split_cost: float = 0.0,
) -> int:
    """Slices per sequence, each at least 256 tokens, at most 64. Knowing how many programs an SM holds at
    once, the fewest within 3% of the least time, in units of one pass at full occupancy: waves of
    programs over their fill (a last wave half full costs a whole one), plus `split_cost` a slice (the
    partials' bytes over the KV bytes, written and merged). Else about four programs per SM."""
    most = max(1, min(triton.cdiv(max_tokens, 256), 64))
    pairs = max(batch * num_kv_heads, 1)
    if programs_per_sm is None:
        return max(1, min(triton.cdiv(4 * num_sms, pairs), most))
    slots = programs_per_sm * num_sms

    def cost(s: int) -> float:
        return triton.cdiv(pairs * s, slots) * slots / (pairs * s) + split_cost * s

    best = min(cost(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if cost(s) <= 1.03 * best)


def check_gqa_inputs(
    q: torch.Tensor,  # [T, Hq, D]
    k_cache: torch.Tensor,  # [P, S, Hkv, D]
    v_cache: torch.Tensor,  # [P, S, Hkv, Dv]
    seq_lens: torch.Tensor,
    page_table: torch.Tensor,
    expected_tags: torch.Tensor,
    page_tags: torch.Tensor,
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
    check_tag_inputs(page_table, expected_tags, page_tags)
    if seq_lens.dim() != 1 or page_table.shape[0] != B:
        raise ValueError("seq_lens [B], page_table [B, Mp] and expected_tags [B, Mp] must agree")
    if tag_mismatch.shape != (B,) or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    if q.stride(2) != 1 or k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the head dimension of q, k_cache and v_cache must be contiguous")


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
    tiles: str | GQATiles | None = None,  # a DECODE_TILES name or entry; None: DEFAULT_TILES
) -> torch.Tensor:  # [B, Hq, Dv] in q's dtype
    """Attention of each sequence's one new query over its paged K/V; see the module docstring."""
    B, Hq, D = q.shape
    if seq_lens.shape != (B,):
        raise ValueError(
            f"decode takes one query per sequence: q {tuple(q.shape)}, seq_lens {tuple(seq_lens.shape)}"
        )
    check_gqa_inputs(q, k_cache, v_cache, seq_lens, page_table, expected_tags, page_tags, tag_mismatch)
    _, S, Hkv, _ = k_cache.shape
    Dv = v_cache.shape[3]
    out = torch.empty((B, Hq, Dv), dtype=q.dtype, device=q.device)
    if B == 0:
        return out
    G = Hq // Hkv
    cfg = tiles if isinstance(tiles, GQATiles) else decode_tiles(tiles, k_cache.dtype)
    max_tokens = page_table.shape[1] * S
    split_cost = Hq * Dv * 8 / (max_tokens * Hkv * (D + Dv) * k_cache.element_size())  # fp32 partials, twice
    splits = num_splits or pick_num_splits(
        B, Hkv, max_tokens, num_sms(q.device), cfg.programs_per_sm, split_cost
    )
    part_o = torch.empty((B, Hq, splits, Dv), dtype=torch.float32, device=q.device)
    part_lse = torch.empty((B, Hq, splits), dtype=torch.float32, device=q.device)
    block_d = triton.next_power_of_2(D)
    block_dv = triton.next_power_of_2(Dv)
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
        PAGE_SIZE=S,
        GROUP=G,
        BLOCK_H=max(16, triton.next_power_of_2(G)),
        BLOCK_N=cfg.block_n,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        CHECK_TAGS=check_tags,
        COMPUTE=tl.float16 if k_cache.dtype == torch.float8_e4m3fn else TL_DTYPES[q.dtype],
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        **slice_constexprs(cfg, q, k_cache, v_cache, block_d, block_dv),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"maxnreg": cfg.max_registers} if cfg.max_registers else {}),
    )
    merge_splits(part_o, part_lse, out, v_scale)
    return out

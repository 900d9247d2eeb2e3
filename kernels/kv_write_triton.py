"""Writing new tokens' KV into the paged cache on the GPU: `kv_write_ref`'s Triton op, same signature.

One kernel (`_kv_write_kernel`, grid `(T, cdiv(W, BLOCK_W))` over the W values of a token's line:
576 for an MLA latent, Hkv·D for GQA K or V, Di for indexer keys; with a second cache of the pool
(`KvLines`: a DSA layer's indexer keys beside its latent, GQA's V beside K) its blocks follow the
first's on the same grid axis, one launch for both). Each program checks its token's
destination tag beside the value load and stores only where the slot is live (>= 0) and the tag
matches; the first program of a token raises its sequence's flag on a mismatch, so a late or
misrouted write never lands in a page that now belongs to someone else. A slot past the pool is
treated as a mismatch (not written, sequence flagged) where the reference raises IndexError. FP8 divides with IEEE
rounding (`div_rn`, as the CPU reference does; CUDA torch multiplies by the reciprocal instead),
saturates to ±448 and converts round-to-nearest-even, so the bytes equal the CPU reference's.
With `token_expected_tags` None (the engine's check switched off) the kernel is compiled with
CHECK_TAGS off: no tag load, every live slot in the pool is written.

A separate file from `kernels/kv_write.py` because triton is an optional dependency (`gpu` extra):
the CPU path imports only the reference.

Shapes: T new tokens, P pages, S page size, B sequences, W values per token.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from kernels.formats.fp8 import FP8
from kernels.op_args import KvLines
from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["kv_write_triton"]


@triton.jit
def _write_lines(
    cache_ptr,  # [P, S, W]
    values_ptr,  # [T, W]
    page_tags_ptr,  # [P] int64
    token_expected_ptr,  # [T] int64
    t,
    wb,  # this program's block of the line
    slot,
    live,
    in_pool,
    page,
    scale,
    W,
    stride_vt,
    stride_cp,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    QUANT: tl.constexpr,
    FMAX: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
):
    """Block `wb` of token t's line into its slot where live and the tag matches → the tag's verdict."""
    offs = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = offs < W
    # the value load does not wait for the tag loads
    x = tl.load(values_ptr + t.to(tl.int64) * stride_vt + offs, mask=w_ok & live, other=0.0)
    if CHECK_TAGS:
        tag_ok = in_pool & (tl.load(page_tags_ptr + page) == tl.load(token_expected_ptr + t))
    else:
        tag_ok = in_pool
    if QUANT:
        x = tl.math.div_rn(x.to(tl.float32), scale)
        x = tl.minimum(tl.maximum(x, -FMAX), FMAX)  # NaN stays NaN, as torch's clamp leaves it
    dst = cache_ptr + page * stride_cp + (slot % PAGE_SIZE) * stride_cs + offs
    tl.store(dst, x.to(cache_ptr.dtype.element_ty), mask=w_ok & live & tag_ok)
    return tag_ok


@triton.jit
def _kv_write_kernel(
    cache_ptr,  # [P, S, W] (trailing dims flattened)
    values_ptr,  # [T, W]
    cache2_ptr,  # [P, S, W2] the second cache (TWO), else a placeholder
    values2_ptr,  # [T, W2]
    slot_ptr,  # [T] int64 page * S + offset, < 0 = skip
    page_tags_ptr,  # [P] int64
    token_expected_ptr,  # [T] int64
    token_seq_ptr,  # [T] int64
    mismatch_ptr,  # [B] uint8 (the bool flags, viewed)
    scale,  # FP8 only: stored = value / scale
    scale2,
    W,
    W2,
    num_slots,  # P * S
    stride_vt,
    stride_cp,
    stride_cs,
    stride_v2t,
    stride_c2p,
    stride_c2s,
    num_blocks,  # program_id(1) below it: the first cache's blocks; from it: the second's
    PAGE_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK_W2: tl.constexpr,
    QUANT: tl.constexpr,  # FP8 cache: divide, saturate to ±FMAX, convert
    FMAX: tl.constexpr,
    QUANT2: tl.constexpr,
    FMAX2: tl.constexpr,
    TWO: tl.constexpr,  # a second cache of the pool, written at the same slots under the same checks
    CHECK_TAGS: tl.constexpr,  # False: no tag is loaded (token_expected_ptr is then a placeholder)
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    wb = tl.program_id(1)
    slot = tl.load(slot_ptr + t)
    live = slot >= 0
    in_pool = slot < num_slots  # a slot past the pool is never written (the reference would raise)
    page = tl.where(live & in_pool, slot // PAGE_SIZE, 0)
    if wb < num_blocks:
        tag_ok = _write_lines(
            cache_ptr, values_ptr, page_tags_ptr, token_expected_ptr, t, wb, slot, live, in_pool, page, scale, W,
            stride_vt, stride_cp, stride_cs, PAGE_SIZE, BLOCK_W, QUANT, FMAX, CHECK_TAGS,
        )  # fmt: skip
        if CHECK_TAGS:  # the first program of a token raises its sequence's flag
            bad = live & (tag_ok == 0) & (wb == 0)
            seq = tl.load(token_seq_ptr + t, mask=bad, other=0)
            tl.store(mismatch_ptr + seq, 1, mask=bad)
    if TWO:  # noqa: SIM102 (a constexpr: one cache compiles no second branch)
        if wb >= num_blocks:
            _write_lines(
                cache2_ptr, values2_ptr, page_tags_ptr, token_expected_ptr, t, wb - num_blocks, slot, live, in_pool,
                page, scale2, W2, stride_v2t, stride_c2p, stride_c2s, PAGE_SIZE, BLOCK_W2, QUANT2, FMAX2, CHECK_TAGS,
            )  # fmt: skip


_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)


def _trailing_contiguous(t: torch.Tensor, first: int) -> bool:
    """Dims `first..` of `t` are laid out contiguously (so they flatten to one row)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[first:]), reversed(t.stride()[first:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _rows(cache: torch.Tensor, values: torch.Tensor, T: int) -> torch.Tensor:
    """`values` as [T, W] rows with unit stride in W, after checking it fits `cache`."""
    if values.shape[0] != T or values.shape[1:] != cache.shape[2:]:
        raise ValueError(f"values {tuple(values.shape)} do not fit cache {tuple(cache.shape)}")
    if cache.dtype not in _CACHE_DTYPES or values.dtype not in _CACHE_DTYPES[:3]:
        raise TypeError(f"cache {cache.dtype} / values {values.dtype} not supported")
    if not _trailing_contiguous(cache, 2):
        raise ValueError("the cache's per-token dims must be contiguous")
    rows = values.reshape(T, math.prod(cache.shape[2:]))  # a view where the per-token dims are contiguous
    return rows if rows.stride(1) == 1 else rows.contiguous()


def kv_write_triton(
    cache: torch.Tensor,  # [P, S, *shape] fp16 / bf16 / fp32 / float8_e4m3fn
    values: torch.Tensor,  # [T, *shape] fp16 / bf16 / fp32
    slot_mapping: torch.Tensor,  # [T] int64 page * S + offset, < 0 = skip
    scale: float,
    page_tags: torch.Tensor,  # [P] int64 tags the pages carry now
    token_expected_tags: torch.Tensor | None,  # [T] int64 tag token t's destination page should carry
    token_seq: torch.Tensor,  # [T] int64 sequence of token t
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    second: KvLines | None = None,  # [P, S, *shape2] another cache of the pool, in the same launch
) -> None:
    """`kv_write_ref` on the GPU (same signature, same bytes); see the module docstring."""
    P, S = cache.shape[:2]
    T = values.shape[0]
    rows = _rows(cache, values, T)
    check_tags = token_expected_tags is not None
    expected = token_expected_tags if token_expected_tags is not None else slot_mapping  # unread when off
    for name, x in (
        ("slot_mapping", slot_mapping),
        ("token_expected_tags", expected),
        ("token_seq", token_seq),
    ):
        if x.shape != (T,) or x.dtype != torch.int64:
            raise ValueError(f"{name} must be int64 [T], got {x.dtype} {tuple(x.shape)}")
    if page_tags.shape != (P,) or page_tags.dtype != torch.int64 or page_tags.stride(0) != 1:
        raise ValueError("page_tags must be a contiguous int64 [P]")
    if tag_mismatch.dim() != 1 or tag_mismatch.dtype != torch.bool:
        raise ValueError("tag_mismatch must be bool [B]")
    cache2, rows2, scale2 = cache, rows, scale  # placeholders the one-cache kernel never reads
    if second is not None:
        if second.cache.shape[:2] != (P, S):
            raise ValueError(f"the second cache must be [{P}, {S}, ...], got {tuple(second.cache.shape)}")
        cache2, rows2, scale2 = second.cache, _rows(second.cache, second.values, T), second.scale
    W, W2 = rows.shape[1], rows2.shape[1]
    block_w, block_w2 = (
        min(1024, triton.next_power_of_2(max(W, 1))),
        min(1024, triton.next_power_of_2(max(W2, 1))),
    )
    num_blocks = triton.cdiv(W, block_w)
    num_blocks2 = triton.cdiv(W2, block_w2) if second is not None else 0
    if T == 0 or num_blocks + num_blocks2 == 0:
        return
    quant, quant2 = cache.dtype == FP8, cache2.dtype == FP8
    _kv_write_kernel[(T, num_blocks + num_blocks2)](
        cache, rows, cache2, rows2, slot_mapping, page_tags, expected, token_seq, tag_mismatch.view(torch.uint8),
        scale, scale2, W, W2, P * S, rows.stride(0), cache.stride(0), cache.stride(1), rows2.stride(0),
        cache2.stride(0), cache2.stride(1), num_blocks,
        PAGE_SIZE=S, BLOCK_W=block_w, BLOCK_W2=block_w2, QUANT=quant, FMAX=torch.finfo(cache.dtype).max if quant else 0.0,
        QUANT2=quant2, FMAX2=torch.finfo(cache2.dtype).max if quant2 else 0.0, TWO=second is not None,
        CHECK_TAGS=check_tags, **pdl_args(cache.device), num_warps=4,
    )  # fmt: skip

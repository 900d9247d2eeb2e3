"""Writing new tokens' KV into the paged cache on the GPU: `kv_write_ref`'s Triton op, same signature.

One kernel (`_kv_write_kernel`, grid `(T, cdiv(W, BLOCK_W))` over the W values of a token's line:
576 for an MLA latent, Hkv·D for GQA K or V, Di for indexer keys). Each program checks its token's
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
from kernels.triton_lib import pdl_args, pdl_enter

__all__ = ["kv_write_triton"]


@triton.jit
def _kv_write_kernel(
    cache_ptr,  # [P, S, W] (trailing dims flattened)
    values_ptr,  # [T, W]
    slot_ptr,  # [T] int64 page * S + offset, < 0 = skip
    page_tags_ptr,  # [P] int64
    token_expected_ptr,  # [T] int64
    token_seq_ptr,  # [T] int64
    mismatch_ptr,  # [B] uint8 (the bool flags, viewed)
    scale,  # FP8 only: stored = value / scale
    W,
    num_slots,  # P * S
    stride_vt,
    stride_cp,
    stride_cs,
    PAGE_SIZE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    QUANT: tl.constexpr,  # FP8 cache: divide, saturate to ±FMAX, convert
    FMAX: tl.constexpr,
    CHECK_TAGS: tl.constexpr,  # False: no tag is loaded (token_expected_ptr is then a placeholder)
    PDL: tl.constexpr,  # launched with PDL (`kernels/triton_lib.py`): it reads nothing before the wait
):
    pdl_enter(PDL)
    t = tl.program_id(0)
    wb = tl.program_id(1)
    offs = wb * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = offs < W
    slot = tl.load(slot_ptr + t)
    live = slot >= 0
    in_pool = slot < num_slots  # a slot past the pool is never written (the reference would raise)
    page = tl.where(live & in_pool, slot // PAGE_SIZE, 0)
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
    if CHECK_TAGS:
        bad = live & (tag_ok == 0) & (wb == 0)
        seq = tl.load(token_seq_ptr + t, mask=bad, other=0)
        tl.store(mismatch_ptr + seq, 1, mask=bad)


_CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, FP8)


def _trailing_contiguous(t: torch.Tensor, first: int) -> bool:
    """Dims `first..` of `t` are laid out contiguously (so they flatten to one row)."""
    expected = 1
    for size, stride in zip(reversed(t.shape[first:]), reversed(t.stride()[first:]), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def kv_write_triton(
    cache: torch.Tensor,  # [P, S, *shape] fp16 / bf16 / fp32 / float8_e4m3fn
    values: torch.Tensor,  # [T, *shape] fp16 / bf16 / fp32
    slot_mapping: torch.Tensor,  # [T] int64 page * S + offset, < 0 = skip
    scale: float,
    page_tags: torch.Tensor,  # [P] int64 tags the pages carry now
    token_expected_tags: torch.Tensor | None,  # [T] int64 tag token t's destination page should carry
    token_seq: torch.Tensor,  # [T] int64 sequence of token t
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
) -> None:
    """`kv_write_ref` on the GPU (same signature, same bytes); see the module docstring."""
    P, S = cache.shape[:2]
    T = values.shape[0]
    if values.shape[1:] != cache.shape[2:]:
        raise ValueError(f"values {tuple(values.shape)} do not fit cache {tuple(cache.shape)}")
    if cache.dtype not in _CACHE_DTYPES or values.dtype not in _CACHE_DTYPES[:3]:
        raise TypeError(f"cache {cache.dtype} / values {values.dtype} not supported")
    if not _trailing_contiguous(cache, 2):
        raise ValueError("the cache's per-token dims must be contiguous")
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
    W = math.prod(cache.shape[2:])
    if T == 0 or W == 0:
        return
    rows = values.reshape(T, W)  # a view where the per-token dims are contiguous, else a copy
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    block_w = min(1024, triton.next_power_of_2(W))
    is_fp8 = cache.dtype == FP8
    _kv_write_kernel[(T, triton.cdiv(W, block_w))](
        cache,
        rows,
        slot_mapping,
        page_tags,
        expected,
        token_seq,
        tag_mismatch.view(torch.uint8),
        scale,
        W,
        P * S,
        rows.stride(0),
        cache.stride(0),
        cache.stride(1),
        PAGE_SIZE=S,
        BLOCK_W=block_w,
        QUANT=is_fp8,
        FMAX=torch.finfo(cache.dtype).max if is_fp8 else 0.0,
        CHECK_TAGS=check_tags,
        **pdl_args(cache.device),
        num_warps=4,
    )

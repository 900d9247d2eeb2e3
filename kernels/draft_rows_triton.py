"""The chained draft depths' rows in one launch (the op and its reference are `kernels/draft_rows.py`):
a program per BLOCK_B sequences, every depth.

Shapes: B sequences, W page-table columns, D draft depths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["draft_rows_triton"]

BLOCK_B = 128


@triton.jit
def _draft_rows_kernel(
    first_ptr,  # [B] int64, `stride_first` apart (a verify's first rows: k + 1 apart)
    accepted_ptr,  # [B] int64
    table_ptr,  # [B, W] int32
    tags_ptr,  # [B, W] int64 (CHECK_TAGS)
    pos_ptr,  # [D, B] int64 out
    slot_ptr,  # [D, B] int64 out
    tag_out_ptr,  # [D, B] int64 out (CHECK_TAGS)
    len_ptr,  # [D, B] out, the seq_lens dtype
    B,
    W,
    stride_first,
    stride_table,
    stride_tags,
    S,
    D: tl.constexpr,
    CHECK_TAGS: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    b = tl.program_id(0) * BLOCK_B + tl.arange(0, BLOCK_B)
    keep = b < B
    base = tl.load(first_ptr + b * stride_first, mask=keep, other=0) + tl.load(
        accepted_ptr + b, mask=keep, other=0
    )
    for d in tl.static_range(1, D + 1):
        pos = base + d  # int64
        col = pos // S
        # a column past the table (the step reserves every one it reads: never, unless a reservation
        # is wrong) reads tag -1, which no page carries: the write is refused and the sequence flagged
        in_table = keep & (col < W)
        page = tl.load(table_ptr + b.to(tl.int64) * stride_table + col, mask=in_table, other=0).to(tl.int64)
        out = (d - 1) * B + b
        tl.store(pos_ptr + out, pos, mask=keep)
        tl.store(slot_ptr + out, page * S + (pos - col * S), mask=keep)
        tl.store(len_ptr + out, (pos + 1).to(len_ptr.dtype.element_ty), mask=keep)
        if CHECK_TAGS:
            tag = tl.load(tags_ptr + b.to(tl.int64) * stride_tags + col, mask=in_table, other=-1)
            tl.store(tag_out_ptr + out, tag, mask=keep)


def draft_rows_triton(
    first: torch.Tensor,  # [B] int64, any stride
    accepted: torch.Tensor,  # [B] int64
    page_table: torch.Tensor,  # [B, W] int32, unit stride in W
    expected_tags: torch.Tensor | None,  # [B, W] int64, unit stride in W
    page_size: int,
    num_depths: int,
    seq_lens_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(positions, slots, tags or None, seq_lens), each `[D, B]`: `draft_rows_ref`'s, in one launch."""
    B, D = first.shape[0], num_depths
    if first.dtype != torch.int64 or accepted.dtype != torch.int64 or accepted.shape != (B,):
        raise ValueError("first and accepted must be int64 [B]")
    if page_table.dim() != 2 or page_table.shape[0] != B or page_table.stride(1) != 1:
        raise ValueError(f"page_table must be [{B}, W] with unit stride in W, got {tuple(page_table.shape)}")
    if expected_tags is not None and (
        expected_tags.shape != page_table.shape or expected_tags.stride(1) != 1
    ):
        raise ValueError("expected_tags must be page_table's shape, unit stride in W")
    if D < 1:
        raise ValueError(f"num_depths must be >= 1, got {D}")
    dev = first.device
    positions = torch.empty((D, B), dtype=torch.int64, device=dev)
    slots = torch.empty((D, B), dtype=torch.int64, device=dev)
    tags = torch.empty((D, B), dtype=torch.int64, device=dev) if expected_tags is not None else None
    seq_lens = torch.empty((D, B), dtype=seq_lens_dtype, device=dev)
    if B:
        check = expected_tags is not None
        _draft_rows_kernel[(triton.cdiv(B, BLOCK_B),)](
            first, accepted.contiguous(), page_table, expected_tags if check else page_table,
            positions, slots, tags if check else positions, seq_lens, B, page_table.shape[1], first.stride(0),
            page_table.stride(0),
            expected_tags.stride(0) if expected_tags is not None else 0, page_size,
            D=D, CHECK_TAGS=check, BLOCK_B=BLOCK_B,
        )  # fmt: skip
    return positions, slots, tags, seq_lens

"""The rows of a whole speculative step's chained draft depths: the op's public entry
`draft_rows(args)` (one Triton launch on CUDA, `kernels/draft_rows_triton.py`, where the torch
reference is about a dozen), the torch reference `draft_rows_ref` elsewhere.

After a uniform verify of B sequences (k + 1 rows each, sequence b's newest token at position p_b)
that accepted a_b drafts, draft depth d (1 … k − 1) runs one row per sequence at position
p_b + a_b + d (backend/engine/speculative/greedy.py). Each row needs its position, its KV slot (the
page its position falls in, from the sequence's page table, times the page size, plus the offset in
the page), the tag that page must carry, and the sequence's length after it. The page tables hold
the pages of every position the step may write (n + 2k − 1 tokens are reserved before the step),
so every column read is one the block manager filled.

Shapes: B sequences, W page-table columns, D = k − 1 draft depths (depth-major outputs `[D, B]`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DraftRowsArgs:
    first: torch.Tensor  # [B] int64 each sequence's newest token's position (its verify's first row)
    accepted: torch.Tensor  # [B] int64 the drafts each sequence accepted
    page_table: torch.Tensor  # [B, W] int32, unit stride in W
    expected_tags: torch.Tensor | None  # [B, W] int64 unit stride in W; None: the tag check off
    page_size: int
    num_depths: int  # D = k − 1 >= 1
    seq_lens_dtype: torch.dtype  # the batch's `seq_lens` dtype


@dataclass(frozen=True, slots=True)
class DraftRows:
    positions: torch.Tensor  # [D, B] int64
    slots: torch.Tensor  # [D, B] int64: page · S + position mod S
    tags: torch.Tensor | None  # [D, B] int64 the tag of each row's page; None: the check off
    seq_lens: torch.Tensor  # [D, B] the sequence's length with the row, `seq_lens_dtype`


def draft_rows(args: DraftRowsArgs) -> DraftRows:
    """The op. Triton on CUDA (triton is the gpu extra: imported only there), the reference elsewhere."""
    if args.first.is_cuda:
        from kernels.draft_rows_triton import draft_rows_triton

        a = args
        return DraftRows(
            *draft_rows_triton(
                a.first,
                a.accepted,
                a.page_table,
                a.expected_tags,
                a.page_size,
                a.num_depths,
                a.seq_lens_dtype,
            )
        )
    return draft_rows_ref(args)


def draft_rows_ref(args: DraftRowsArgs) -> DraftRows:
    B, D, S = args.first.shape[0], args.num_depths, args.page_size
    rows = torch.arange(B, device=args.first.device)  # [B]
    offsets = torch.arange(1, D + 1, device=args.first.device)  # [D] depths 1 … D
    positions = (args.first + args.accepted)[None, :] + offsets[:, None]  # [D, B]
    columns = positions // S  # [D, B] the page-table column of each
    slots = positions + (args.page_table[rows, columns].long() - columns) * S  # page · S + position mod S
    tags = args.expected_tags[rows, columns] if args.expected_tags is not None else None
    return DraftRows(positions, slots, tags, (positions + 1).to(args.seq_lens_dtype))

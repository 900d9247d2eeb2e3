"""Reading one sequence's tokens out of the paged cache, with the page-tag check applied (the
reference page-tag verification, fused into every page-reading kernel on the GPU, lives here too).

Shared by the paged attention, MLA attention and DSA indexer references: every page-reading op
checks tags for the whole batch first (`check_tags_ref`), then gathers each sequence's tokens with a
`valid` mask that drops every token of a page whose tag did not match. `PagedBatch` is what those
ops' argument structs share: the step's sequences, their pages and the tags they must carry.

Shapes: P pages, S page size, B sequences, Mp max pages per sequence, L tokens of one sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


def check_tag_inputs(
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    page_tags: torch.Tensor,  # [P] int64
) -> None:
    """What every page-reading kernel's fused tag check needs of its inputs; raises on the first misfit.
    The kernels index `page_tags` by page id with no stride and compare 64-bit tags: an int32 tag vector
    or a strided view would compare the wrong words, so the launchers refuse them (issue 27)."""
    if page_table.dtype != torch.int32:
        raise TypeError(f"page_table must be int32, got {page_table.dtype}")
    if expected_tags.dtype != torch.int64 or page_tags.dtype != torch.int64:
        raise TypeError(
            f"expected_tags and page_tags must be int64, got {expected_tags.dtype}/{page_tags.dtype}"
        )
    if page_table.dim() != 2 or expected_tags.shape != page_table.shape:
        raise ValueError(
            f"page_table and expected_tags must be [B, Mp] alike, got {tuple(page_table.shape)}"
            f"/{tuple(expected_tags.shape)}"
        )
    if page_tags.dim() != 1 or page_tags.stride(0) != 1:
        raise ValueError(f"page_tags must be a contiguous [P], got shape {tuple(page_tags.shape)}")
    if page_table.stride(1) != 1 or expected_tags.stride(1) != 1:
        raise ValueError("page_table and expected_tags rows must be contiguous")


def check_page_tags_ref(
    page_tags: torch.Tensor,  # [P] int64 tags the pages carry now
    page_table: torch.Tensor,  # [B, Mp] int32 physical page ids
    expected_tags: torch.Tensor,  # [B, Mp] int64 tags each sequence expects
    num_pages: torch.Tensor,  # [B] int pages in use by each sequence
) -> torch.Tensor:
    """Return `ok [B, Mp]` bool: page i of sequence b is in use and carries the expected tag.

    Pages past `num_pages[b]` are reported not ok but are not mismatches; use `mismatch_from_ok`.
    """
    B, Mp = page_table.shape
    in_use = torch.arange(Mp, device=page_table.device)[None, :] < num_pages[:, None]  # [B, Mp]
    found = page_tags[page_table.long().clamp(min=0)]  # [B, Mp]
    return in_use & (found == expected_tags)


def mismatch_from_ok(ok: torch.Tensor, num_pages: torch.Tensor) -> torch.Tensor:
    """`[B]` bool: some page in use by sequence b carries the wrong tag."""
    Mp = ok.shape[1]
    in_use = torch.arange(Mp, device=ok.device)[None, :] < num_pages[:, None]
    return (in_use & ~ok).any(dim=1)


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """One step's sequences as every page-reading op sees them (built once per step)."""

    query_start: torch.Tensor  # [B+1] int32 first query row of each sequence
    seq_lens: torch.Tensor  # [B] int32 cached tokens, the new ones included
    page_table: torch.Tensor  # [B, Mp] int32
    expected_tags: torch.Tensor  # [B, Mp] int64 the tag each page must carry
    page_tags: torch.Tensor  # [P] int64 the tags the pages carry now
    tag_mismatch: torch.Tensor  # [B] bool, OR-ed in place where a page's tag is wrong
    is_decode: bool = False  # one query per sequence (query_start = 0..B): the decode kernels
    check_tags: bool = True  # False only to measure the check's cost (no tag is read)
    # what the ops derive from these tensors alike in every layer of the step (the DSA indexer's query
    # tiles: 3 launches a layer otherwise), made by the first layer's op and reused
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


def check_tags_ref(
    page_tags: torch.Tensor,  # [P] int64
    page_table: torch.Tensor,  # [B, Mp] int32
    expected_tags: torch.Tensor,  # [B, Mp] int64
    seq_lens: torch.Tensor,  # [B] int
    page_size: int,
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
    check_tags: bool = True,
) -> torch.Tensor:
    """`ok [B, Mp]`: page i of sequence b is in use and carries its expected tag; flags mismatches.
    With `check_tags` False (measuring the check's cost) no tag is read: every page in use is ok."""
    num_pages = (seq_lens.long() + page_size - 1) // page_size
    if not check_tags:
        return torch.arange(page_table.shape[1], device=page_table.device)[None, :] < num_pages[:, None]
    ok = check_page_tags_ref(page_tags, page_table, expected_tags, num_pages)
    tag_mismatch |= mismatch_from_ok(ok, num_pages)
    return ok


def gather_sequence_ref(
    cache: torch.Tensor,  # [P, S, *shape] stored dtype
    scale: float,
    pages: torch.Tensor,  # [Mp] int32 this sequence's page ids
    ok: torch.Tensor,  # [Mp] bool this sequence's tag check
    seq_len: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(values [L, *shape] float32 = stored * scale, valid [L] bool)` for the sequence's L tokens."""
    S = cache.shape[1]
    n = (seq_len + S - 1) // S
    values = cache[pages[:n].long()].float().reshape(n * S, *cache.shape[2:])[:seq_len] * scale
    valid = ok[:n].repeat_interleave(S)[:seq_len]
    # a page that failed its check may hold anything (even NaN from another tenant's FP8 bytes)
    values = torch.where(valid.view(-1, *([1] * (values.dim() - 1))), values, torch.zeros_like(values))
    return values, valid


def causal_mask(num_queries: int, seq_len: int, device: torch.device) -> torch.Tensor:
    """`[Q, L]` bool: query i (the last Q tokens of the sequence) may see token j ≤ its own index."""
    q_idx = torch.arange(seq_len - num_queries, seq_len, device=device)
    return torch.arange(seq_len, device=device)[None, :] <= q_idx[:, None]

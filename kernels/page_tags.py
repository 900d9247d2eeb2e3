"""Page-tag verification: the reference op that every page-reading op calls (fused on the GPU).

Shapes: B sequences, Mp = max pages per sequence, P = physical pages.
"""

from __future__ import annotations

import torch


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

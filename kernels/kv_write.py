"""Writing new tokens' KV into the paged cache, at `slot_mapping`, checking the destination's tag.

Reference op; the GPU launcher `kv_write(...)` keeps this signature. FP8 caches store
`value / scale` saturated to the e4m3 range (value = stored * scale on read). A token whose
destination page does not carry the tag its sequence expects is not written, and its sequence is
flagged in `tag_mismatch` (the engine aborts it): a late or misrouted write can never land in a page
that now belongs to someone else. A negative slot is padding and is skipped. With
`token_expected_tags` None (the engine's tag check switched off, to measure its cost) every live
slot is written and no tag is read.

Shapes: T new tokens, P pages, S page size, B sequences.
"""

from __future__ import annotations

import torch

FP8_DTYPES = (torch.float8_e4m3fn,)


def quantize_for_cache(values: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    if dtype in FP8_DTYPES:
        fmax = torch.finfo(dtype).max
        return (values.float() / scale).clamp(-fmax, fmax).to(dtype)
    return values.to(dtype)


def kv_write_ref(
    cache: torch.Tensor,  # [P, S, *shape]
    values: torch.Tensor,  # [T, *shape]
    slot_mapping: torch.Tensor,  # [T] int64 page * S + offset, < 0 = skip
    scale: float,
    page_tags: torch.Tensor,  # [P] int64 tags the pages carry now
    token_expected_tags: torch.Tensor | None,  # [T] int64 tag token t's destination page should carry
    token_seq: torch.Tensor,  # [T] int64 sequence of token t
    tag_mismatch: torch.Tensor,  # [B] bool, OR-ed in place
) -> None:
    S = cache.shape[1]
    slots = slot_mapping.long()
    write = slots >= 0  # [T] live
    if token_expected_tags is not None:
        pages = torch.where(write, slots // S, torch.zeros_like(slots))
        tag_ok = page_tags[pages] == token_expected_tags
        bad = write & ~tag_ok
        if bool(bad.any()):
            tag_mismatch[token_seq[bad].unique()] = True
        write = write & tag_ok
    flat = cache.view(cache.shape[0] * S, *cache.shape[2:])
    flat[slots[write]] = quantize_for_cache(values[write], cache.dtype, scale)

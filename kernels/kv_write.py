"""Writing new tokens' KV into the paged cache, at `slot_mapping`, checking the destination's tag.

The op's public entry is `kv_write(args)`: the Triton op of `kernels/kv_write_triton.py` on CUDA (no
host sync, so a step can be captured in a CUDA graph), the torch reference `kv_write_ref` elsewhere;
both take the same positional arguments. FP8 caches store
`value / scale` saturated to the e4m3 range (value = stored * scale on read). A token whose
destination page does not carry the tag its sequence expects is not written, and its sequence is
flagged in `tag_mismatch` (the engine aborts it): a late or misrouted write can never land in a page
that now belongs to someone else. A negative slot is padding and is skipped. With
`token_expected_tags` None (the engine's tag check switched off, to measure its cost) every live
slot is written and no tag is read. A second cache of the same pages (`KvLines`: the DSA indexer's
keys beside the MLA latent) may ride on the same call: the same slots and checks, one launch on CUDA.

Shapes: T new tokens, P pages, S page size, B sequences.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.formats.fp8 import FP8
from kernels.op_args import KvLines

FP8_DTYPES = (FP8,)


@dataclass(frozen=True, slots=True)
class KvWriteArgs:
    cache: torch.Tensor  # [P, S, *shape]
    values: torch.Tensor  # [T, *shape]
    slot_mapping: torch.Tensor  # [T] int64 page * S + offset, < 0 = skip
    scale: float
    page_tags: torch.Tensor  # [P] int64 tags the pages carry now
    token_expected_tags: torch.Tensor | None  # [T] int64 tag each destination page must carry; None: off
    token_seq: torch.Tensor  # [T] int64 sequence of token t
    tag_mismatch: torch.Tensor  # [B] bool, OR-ed in place
    second: KvLines | None = None  # a second cache written in the same launch


def kv_write(args: KvWriteArgs) -> None:
    """The op: Triton on CUDA (triton is the gpu extra: imported only there), the reference elsewhere."""
    a = args
    run = kv_write_ref
    if a.values.is_cuda:
        from kernels.kv_write_triton import kv_write_triton as run
    run(
        a.cache,
        a.values,
        a.slot_mapping,
        a.scale,
        a.page_tags,
        a.token_expected_tags,
        a.token_seq,
        a.tag_mismatch,
        a.second,
    )


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
    second: KvLines | None = None,  # another cache of the pool, written at the same slots
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
    if second is not None:  # the same checks: the same tokens written, the same flags raised
        kv_write_ref(
            second.cache, second.values, slot_mapping, second.scale, page_tags, token_expected_tags, token_seq,
            tag_mismatch,
        )  # fmt: skip

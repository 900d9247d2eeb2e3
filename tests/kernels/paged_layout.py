"""Test helper: lay contiguous per-sequence tensors out in a shuffled page pool with tags."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.kv_write import quantize_for_cache


@dataclass
class Paged:
    caches: list[torch.Tensor]  # each [P, S, *shape]
    page_table: torch.Tensor  # [B, Mp] int32
    expected_tags: torch.Tensor  # [B, Mp] int64
    page_tags: torch.Tensor  # [P] int64
    seq_lens: torch.Tensor  # [B] int32
    pages: list[list[int]]


def lay_out(
    per_seq: list[list[torch.Tensor]],  # per sequence, one [L, *shape] tensor per cache
    *,
    page_size: int = 16,
    spare_pages: int = 3,
    dtype: torch.dtype = torch.float32,
    scales: list[float] | None = None,
    seed: int = 0,
) -> Paged:
    g = torch.Generator().manual_seed(seed)
    lens = [int(ts[0].shape[0]) for ts in per_seq]
    counts = [(n + page_size - 1) // page_size for n in lens]
    P = sum(counts) + spare_pages
    order = torch.randperm(P, generator=g).tolist()
    page_tags = torch.randint(1, 2**40, (P,), generator=g)
    scales = scales or [1.0] * len(per_seq[0])
    caches = [
        torch.full((P, page_size, *t.shape[1:]), float("nan")).to(dtype) for t in per_seq[0]
    ]  # unused slots hold NaN: reading one would show
    Mp = max(counts)
    table = torch.zeros(len(per_seq), Mp, dtype=torch.int32)
    tags = torch.full((len(per_seq), Mp), -1, dtype=torch.int64)
    pages: list[list[int]] = []
    for b, ts in enumerate(per_seq):
        mine = [order.pop() for _ in range(counts[b])]
        pages.append(mine)
        table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
        tags[b, : len(mine)] = page_tags[mine]
        for c, (cache, t) in enumerate(zip(caches, ts, strict=True)):
            for i in range(lens[b]):
                cache[mine[i // page_size], i % page_size] = quantize_for_cache(t[i], dtype, scales[c])
    return Paged(caches, table, tags, page_tags, torch.tensor(lens, dtype=torch.int32), pages)


def query_starts(num_queries: list[int]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(num_queries).cumsum(0).tolist()], dtype=torch.int32)


def random_pages(
    seq_lens: list[int], page_size: int, generator: torch.Generator, spare_pages: int = 4
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_table [B, Mp] int32, page_tags [P] int64) on the generator's device: each sequence's
    pages drawn from a shuffled pool, random tags (for GPU tests that fill the pool with random data)."""
    dev = generator.device
    pages_per = [-(-n // page_size) for n in seq_lens]
    P = sum(pages_per) + spare_pages
    perm = torch.randperm(P, device=dev, generator=generator).to(torch.int32)
    table = torch.zeros(len(seq_lens), max(pages_per), dtype=torch.int32, device=dev)
    used = 0
    for b, n in enumerate(pages_per):
        table[b, :n] = perm[used : used + n]
        used += n
    return table, torch.randint(0, 2**40, (P,), device=dev, generator=generator)


def poison_allocator(nbytes: int = 1 << 30) -> None:
    """Fill free blocks of the caching allocator with NaN, so an output element the kernel never
    writes reads NaN (the launchers' `torch.empty` outputs are carved from these blocks)."""
    torch.empty(nbytes // 4, device="cuda").fill_(float("nan"))


def tag_input_misfits(batch: dict) -> list[tuple[str, dict, type[Exception]]]:
    """(what, the batch with it, the error a launcher must raise): the tag-check inputs a kernel would
    misread (an int32 tag vector compared as int64 words, a strided one read without its stride), which
    every page-reading launcher refuses before it launches (issue 27)."""
    tags, expected, table = batch["page_tags"], batch["expected_tags"], batch["page_table"]
    strided = torch.stack([tags, tags], dim=1)[:, 0]  # [P], stride 2
    return [
        ("page_tags int32", {**batch, "page_tags": tags.int()}, TypeError),
        ("expected_tags int32", {**batch, "expected_tags": expected.int()}, TypeError),
        ("page_table int64", {**batch, "page_table": table.long()}, TypeError),
        ("page_tags strided", {**batch, "page_tags": strided}, ValueError),
        ("page_tags 2-D", {**batch, "page_tags": tags[:, None]}, ValueError),
    ]

"""query_tiles' one-query-per-tile path (decode) against the general tiling it shortcuts: the same
tile sequences and first queries, empty sequences and trailing tokens included."""

from __future__ import annotations

import torch
import triton

from kernels.triton_lib import query_tiles


def general_tiles(
    query_start: torch.Tensor, num_tokens: int, block_q: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The general formula, written out: tiles numbered per sequence, then their first queries."""
    qs = query_start.long()
    B = qs.shape[0] - 1
    num_tiles = (qs[1:] - qs[:-1] + block_q - 1) // block_q
    ends = num_tiles.cumsum(0)
    t = torch.arange(min(num_tokens, triton.cdiv(num_tokens, block_q) + B))
    seq = torch.searchsorted(ends, t, right=True)
    own = seq.clamp(max=B - 1)
    return seq.to(torch.int32), (qs[own] + (t - ends[own] + num_tiles[own]) * block_q).to(torch.int32)


def test_one_query_per_tile_matches_the_general_tiling() -> None:
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        B = int(torch.randint(1, 9, (1,), generator=g))
        lens = torch.randint(0, 5, (B,), generator=g)
        qs = torch.cat([torch.zeros(1, dtype=torch.long), lens.cumsum(0)]).to(torch.int32)
        for T in (int(qs[-1]), int(qs[-1]) + 2):  # + 2: tokens past the last sequence (idle tiles)
            tiles = query_tiles(qs, T, 1)
            seq, q0 = general_tiles(qs, T, 1)
            assert torch.equal(tiles.tile_seq, seq) and torch.equal(tiles.tile_q0, q0), lens
            assert tiles.query_start.dtype == torch.int32 and torch.equal(tiles.query_start, qs)

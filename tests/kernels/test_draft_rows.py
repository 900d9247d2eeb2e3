"""The chained draft depths' rows (`kernels/draft_rows.py`): the one-launch kernel against the torch
reference (under TRITON_INTERPRET=1 in CI, on the GPU through the device tool), and the reference
against the rows written out by hand."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from kernels.draft_rows import DraftRowsArgs, draft_rows_ref  # noqa: E402
from kernels.draft_rows_triton import draft_rows_triton  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def batch(B: int, W: int, S: int, L: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    table = torch.randperm(B * W + 7, generator=g)[: B * W].view(B, W).to(torch.int32)
    tags = torch.randint(0, 2**40, (B, W), generator=g)
    # each verify's first row (its newest token), k + 1 rows apart in the verify's positions
    newest = torch.randint(0, (W - 2) * S - 2 * L, (B,), generator=g)
    positions = (newest[:, None] + torch.arange(L)[None, :]).reshape(-1)
    accepted = torch.randint(0, L, (B,), generator=g)
    return dict(
        table=table, tags=tags, first=positions.view(B, L)[:, 0], accepted=accepted, positions=positions
    )


def test_a_column_past_the_table_reads_no_tag_a_page_carries() -> None:
    """Never reached while reservations hold (every column a step reads is reserved), but a wrong one
    must not read past the table: its tag reads -1, so kv_write refuses the row and flags it."""
    table = torch.tensor([[3, 4]], dtype=torch.int32, device=DEV)
    tags = torch.tensor([[10, 11]], dtype=torch.int64, device=DEV)
    first, accepted = torch.tensor([6], device=DEV), torch.tensor([0], device=DEV)
    _, _, got, _ = draft_rows_triton(first, accepted, table, tags, 4, 2, torch.int32)  # positions 7, 8
    assert got is not None and got.cpu().tolist() == [[11], [-1]]


def test_the_reference_is_the_rows_by_hand() -> None:
    b = batch(3, 6, 4, 4, seed=1)
    got = draft_rows_ref(DraftRowsArgs(b["first"], b["accepted"], b["table"], b["tags"], 4, 2, torch.int32))
    for d in range(2):
        for s in range(3):
            pos = int(b["first"][s] + b["accepted"][s]) + d + 1
            col, off = divmod(pos, 4)
            assert int(got.positions[d, s]) == pos and int(got.seq_lens[d, s]) == pos + 1
            assert int(got.slots[d, s]) == int(b["table"][s, col]) * 4 + off
            assert got.tags is not None and int(got.tags[d, s]) == int(b["tags"][s, col])
    assert got.seq_lens.dtype == torch.int32


@pytest.mark.parametrize(
    ("B", "depths", "check"), [(1, 2, True), (5, 1, True), (130, 2, False), (3, 3, True)]
)
def test_one_launch_is_the_reference(B: int, depths: int, check: bool) -> None:
    """Strided first rows (a verify's, k + 1 apart), more sequences than a program's block, the tag
    check on and off."""
    b = batch(B, 9, 16, depths + 1, seed=B)
    args = DraftRowsArgs(
        b["first"], b["accepted"], b["table"], b["tags"] if check else None, 16, depths, torch.int32
    )
    want = draft_rows_ref(args)
    on = {k: v.to(DEV) for k, v in b.items()}
    on["first"] = on["positions"].view(B, depths + 1)[:, 0]  # a view of the verify's rows, strided
    # a CUDA graph's tables: the first columns of wider buffers (row stride > W)
    wide = torch.zeros(B, 13, dtype=torch.int32, device=DEV)
    wide[:, :9] = on["table"]
    on["table"] = wide[:, :9]
    wide_tags = torch.full((B, 13), -1, dtype=torch.int64, device=DEV)
    wide_tags[:, :9] = on["tags"]
    on["tags"] = wide_tags[:, :9]
    assert on["first"].stride(0) == depths + 1
    got = draft_rows_triton(
        on["first"], on["accepted"], on["table"], on["tags"] if check else None, 16, depths, torch.int32
    )
    for g, w in zip(got, (want.positions, want.slots, want.tags, want.seq_lens), strict=True):
        if w is None:
            assert g is None
            continue
        assert g is not None and g.dtype == w.dtype and torch.equal(g.cpu(), w)

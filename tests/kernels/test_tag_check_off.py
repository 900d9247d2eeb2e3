"""The reference ops with the tag check off (`EngineConfig.check_page_tags` False): no tag is read.

Each op runs twice on the same clean pages: checked with the right tags, then unchecked with a
`page_tags` of length 0 (any read would raise IndexError) and every expected tag wrong. The outputs
are equal and nothing is flagged; the checked op given those wrong tags flags every sequence.
"""

from __future__ import annotations

import pytest
import torch

from kernels.dsa_indexer import dsa_indexer_ref
from kernels.kv_write import kv_write_ref
from kernels.mla_attention import mla_attention_ref
from kernels.paged_attention import paged_attention_ref
from tests.kernels.paged_layout import Paged, lay_out, query_starts

LENS, NUM_Q = [17, 40, 5], [17, 1, 2]  # a prefill, a decode, a two-token chunk
UNREADABLE = torch.empty(0, dtype=torch.int64)  # page_tags no op may index


def run_op(name: str, p: Paged, tags: torch.Tensor, expected: torch.Tensor, check: bool) -> torch.Tensor:
    """One reference op on fixed queries: its output, flattened, then the `tag_mismatch` flags."""
    g = torch.Generator().manual_seed(5)
    T, qs, flags = sum(NUM_Q), query_starts(NUM_Q), torch.zeros(len(LENS), dtype=torch.bool)
    if name == "paged_attention":
        out = paged_attention_ref(
            torch.randn(T, 4, 8, generator=g), p.caches[0], p.caches[1], 1.0, 1.0, qs, p.seq_lens,
            p.page_table, expected, tags, flags, 8**-0.5, check_tags=check,
        )  # fmt: skip
    elif name == "mla_attention":
        out = mla_attention_ref(
            torch.randn(T, 4, 24, generator=g), p.caches[0], 1.0, 16, qs, p.seq_lens, p.page_table,
            expected, tags, flags, 24**-0.5, check_tags=check,
        )  # fmt: skip
    else:
        out = dsa_indexer_ref(
            torch.randn(T, 2, 24, generator=g), torch.rand(T, 2, generator=g), p.caches[0], 1.0, qs,
            p.seq_lens, p.page_table, expected, tags, flags, 24**-0.5, 8, check_tags=check,
        )  # fmt: skip
    return torch.cat([out.float().flatten(), flags.float()])


@pytest.mark.parametrize("name", ["paged_attention", "mla_attention", "dsa_indexer"])
def test_unchecked_op_reads_no_tag_and_matches_the_checked_op_on_clean_pages(name: str) -> None:
    g = torch.Generator().manual_seed(3)
    shapes = {"paged_attention": [(2, 8), (2, 8)], "mla_attention": [(24,)], "dsa_indexer": [(24,)]}[name]
    paged = lay_out([[torch.randn(n, *s, generator=g) for s in shapes] for n in LENS], page_size=16)
    wrong, B = paged.expected_tags ^ (1 << 41), len(LENS)

    checked = run_op(name, paged, paged.page_tags, paged.expected_tags, True)
    unchecked = run_op(name, paged, UNREADABLE, wrong, False)
    assert not checked[-B:].any()
    assert torch.equal(unchecked, checked)
    assert run_op(name, paged, paged.page_tags, wrong, True)[-B:].all()  # on, the wrong tags are caught


def test_unchecked_kv_write_writes_every_live_slot_without_reading_tags() -> None:
    g = torch.Generator().manual_seed(0)
    P, S, T = 6, 4, 9
    values = torch.randn(T, 3, generator=g)
    slots = torch.randperm(P * S, generator=g)[:T]
    slots[2] = -1  # padding: never written
    token_seq = torch.arange(T) % 2
    checked, unchecked = torch.zeros(P, S, 3), torch.zeros(P, S, 3)
    flags = torch.zeros(2, dtype=torch.bool)
    tags = torch.randint(1, 2**40, (P,), generator=g)
    right = tags[slots.clamp(min=0) // S]
    kv_write_ref(checked, values, slots, 1.0, tags, right, token_seq, flags)
    kv_write_ref(unchecked, values, slots, 1.0, UNREADABLE, None, token_seq, flags)
    assert torch.equal(unchecked, checked) and not flags.any()
    assert int((unchecked.flatten(0, 1).abs().sum(-1) > 0).sum()) == T - 1

"""kv_write reference: scatter by slot, FP8 stores value / scale, a wrong destination tag blocks the write."""

from __future__ import annotations

import torch

from kernels.kv_write import kv_write_ref

P, S, D = 4, 16, 8


def test_writes_each_token_at_its_slot_and_skips_padding() -> None:
    cache = torch.zeros(P, S, D)
    tags = torch.tensor([10, 11, 12, 13])
    values = torch.randn(3, D)
    slots = torch.tensor([2 * S + 5, 0 * S + 15, -1])
    mismatch = torch.zeros(2, dtype=torch.bool)
    kv_write_ref(
        cache, values, slots, 1.0, tags, torch.tensor([12, 10, 99]), torch.tensor([0, 1, 1]), mismatch
    )
    assert torch.equal(cache[2, 5], values[0]) and torch.equal(cache[0, 15], values[1])
    assert int((cache != 0).any(-1).sum()) == 2
    assert not mismatch.any()


def test_fp8_stores_value_over_scale() -> None:
    cache = torch.zeros(P, S, D, dtype=torch.float8_e4m3fn)
    values = torch.randn(2, D) * 3
    scale = float(values.abs().max()) / 448
    mismatch = torch.zeros(1, dtype=torch.bool)
    tags = torch.zeros(P, dtype=torch.int64)
    kv_write_ref(
        cache,
        values,
        torch.tensor([1, 2]),
        scale,
        tags,
        torch.zeros(2, dtype=torch.int64),
        torch.zeros(2, dtype=torch.int64),
        mismatch,
    )
    read = cache[0, 1:3].float() * scale
    assert torch.allclose(read, values, rtol=0.07, atol=scale)
    assert torch.equal(cache[0, 1:3], (values / scale).to(torch.float8_e4m3fn))


def test_a_page_with_another_tag_is_not_written_and_its_sequence_is_flagged() -> None:
    cache = torch.zeros(P, S, D)
    tags = torch.tensor([10, 11, 12, 13])
    values = torch.ones(2, D)
    mismatch = torch.zeros(2, dtype=torch.bool)
    # sequence 0 expects page 1 to carry tag 7 (it was reallocated since); sequence 1 is fine
    kv_write_ref(
        cache,
        values,
        torch.tensor([1 * S + 3, 3 * S]),
        1.0,
        tags,
        torch.tensor([7, 13]),
        torch.tensor([0, 1]),
        mismatch,
    )
    assert mismatch.tolist() == [True, False]
    assert torch.equal(cache[1], torch.zeros(S, D))
    assert torch.equal(cache[3, 0], values[1])

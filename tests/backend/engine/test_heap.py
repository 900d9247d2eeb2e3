"""backend/engine/heap.py: start-up's heap leaves the full collections; collections are counted."""

from __future__ import annotations

import gc

from backend.engine import heap


class _Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only a collection frees it


def test_frozen_objects_are_skipped_by_full_collections_until_thawed() -> None:
    long_lived = [{"i": i} for i in range(50_000)]  # a model's and its kernels' objects, in small
    try:
        assert heap.freeze() >= len(long_lived)
        with heap.Collections() as collections:
            gc.collect()
        summary = collections.summary()
        assert summary["full"] == 1 and summary["full_ms"] >= 0.0
        # garbage made after the freeze is still collected
        garbage = _Node()
        gc.collect()
        del garbage
        assert gc.collect() >= 1
    finally:
        heap.thaw()
    assert gc.get_freeze_count() == 0


def test_collections_are_counted_by_generation_only_while_open() -> None:
    with heap.Collections() as collections:
        gc.collect(0)
        gc.collect(2)
    gc.collect()  # closed: not counted
    summary = collections.summary()
    assert summary["young"] == 1 and summary["full"] == 1
    assert collections.count == [1, 0, 1]

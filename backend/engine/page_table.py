"""Page tables: each sequence's (page id, expected tag) pairs, kept as rows of two host arrays.

Every step hands attention the page table of every scheduled sequence. Kept as Python lists of
`PageRef`, that meant walking every page of every sequence on every step; here a table is one row of
a pool (`PageTables`) that changes only where an entry is written (a page allocated or shared, or a
test scribbling on an entry), and the runner gathers the rows of a step with one numpy fancy index
(`PageTables.gather`). Nothing is rebuilt per step.

The block manager owns the pool and attaches a sequence's table to a row when it gives it its first
pages, and detaches it when it releases them; a detached table is empty. Entries past a table's
length hold the padding of `ForwardBatch` (page 0, tag -1). The pool grows (rows, width) by
doubling when a table needs more; it holds no tensors (the runner turns gathered rows into them).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import overload

import numpy as np

PAD_PAGE = 0  # ForwardBatch's padding past a sequence's pages
PAD_TAG = -1


@dataclass(slots=True)
class PageRef:
    page_id: int
    tag: int


class PageTable:
    """One sequence's pages in order, as a row of its pool; list-like (`append`, `[i]`, `[i] =`)."""

    __slots__ = ("length", "pool", "row")

    def __init__(self) -> None:
        self.pool: PageTables | None = None  # None: detached (the sequence holds no pages)
        self.row = -1
        self.length = 0

    def __len__(self) -> int:
        return self.length

    def __bool__(self) -> bool:
        return self.length > 0

    @overload
    def __getitem__(self, i: int) -> PageRef: ...
    @overload
    def __getitem__(self, i: slice) -> list[PageRef]: ...
    def __getitem__(self, i: int | slice) -> PageRef | list[PageRef]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.length))]
        j = self._index(i)
        pool = self._pool()
        return PageRef(int(pool.page_ids[self.row, j]), int(pool.tags[self.row, j]))

    def __setitem__(self, i: int, ref: PageRef) -> None:
        j = self._index(i)
        pool = self._pool()
        pool.page_ids[self.row, j], pool.tags[self.row, j] = ref.page_id, ref.tag

    def __iter__(self) -> Iterator[PageRef]:
        return iter(self[:])

    def append(self, ref: PageRef) -> None:
        pool = self._pool()
        if self.length == pool.width:
            pool.grow(width=2 * pool.width)
        pool.page_ids[self.row, self.length], pool.tags[self.row, self.length] = ref.page_id, ref.tag
        self.length += 1

    def truncate(self, length: int) -> None:
        """Keep the first `length` entries; those past them go back to the padding."""
        if length < self.length:
            pool = self._pool()
            pool.page_ids[self.row, length : self.length] = PAD_PAGE
            pool.tags[self.row, length : self.length] = PAD_TAG
            self.length = length

    def page_id_list(self) -> list[int]:
        return self._pool().page_ids[self.row, : self.length].tolist()  # type: ignore[no-any-return]

    def _index(self, i: int) -> int:
        j = i + self.length if i < 0 else i
        if not 0 <= j < self.length:
            raise IndexError(f"page table index {i} out of range ({self.length} pages)")
        return j

    def _pool(self) -> PageTables:
        assert self.pool is not None, "a detached page table holds no pages"
        return self.pool


class PageTables:
    """The pool: `page_ids [R, W]` int32 and `tags [R, W]` int64, one row per attached table."""

    def __init__(self, num_rows: int = 8, width: int = 8) -> None:
        self.page_ids = np.full((num_rows, width), PAD_PAGE, dtype=np.int32)
        self.tags = np.full((num_rows, width), PAD_TAG, dtype=np.int64)
        self._free_rows = list(range(num_rows - 1, -1, -1))  # popped from the end: row 0 first

    @property
    def width(self) -> int:
        return int(self.page_ids.shape[1])

    @property
    def num_attached(self) -> int:
        return self.page_ids.shape[0] - len(self._free_rows)

    def attach(self, table: PageTable) -> None:
        """Give an empty, detached `table` a row of its own."""
        assert table.pool is None and not table, "attach() on a table that is already attached"
        if not self._free_rows:
            self.grow(num_rows=2 * self.page_ids.shape[0])
        table.pool, table.row, table.length = self, self._free_rows.pop(), 0

    def detach(self, table: PageTable) -> None:
        """Empty `table` and give its row back (its entries reset to the padding)."""
        if table.pool is None:
            return
        assert table.pool is self, "a table is detached by the pool that attached it"
        self.page_ids[table.row, : table.length] = PAD_PAGE
        self.tags[table.row, : table.length] = PAD_TAG
        self._free_rows.append(table.row)
        table.pool, table.row, table.length = None, -1, 0

    def grow(self, *, num_rows: int | None = None, width: int | None = None) -> None:
        R, W = self.page_ids.shape
        R2, W2 = max(num_rows or R, R), max(width or W, W)
        ids = np.full((R2, W2), PAD_PAGE, dtype=np.int32)
        tags = np.full((R2, W2), PAD_TAG, dtype=np.int64)
        ids[:R, :W], tags[:R, :W] = self.page_ids, self.tags
        self.page_ids, self.tags = ids, tags
        self._free_rows = list(range(R2 - 1, R - 1, -1)) + self._free_rows

    def gather(
        self, rows: np.ndarray, lengths: np.ndarray, num_pages: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray]:
        """`(page_ids [B, Mp] int32, tags [B, Mp] int64)` of the tables at `rows` (whose lengths are
        `lengths`), each cut to its first `num_pages[b]` entries (the pages the step uses) and padded
        past them; Mp = the largest `num_pages`."""
        extra = lengths - num_pages  # [B] entries past the pages in use
        assert extra.min() >= 0, "a step uses a page its sequence's table does not hold"
        width = int(num_pages.max())
        ids, tags = self.page_ids[rows, :width], self.tags[rows, :width]  # copies (fancy index)
        if extra.any():  # a table longer than the step uses (a chunk mid-prompt): hide the rest
            past = np.arange(width)[None, :] >= num_pages[:, None]  # [B, Mp]
            ids[past], tags[past] = PAD_PAGE, PAD_TAG
        return ids, tags

"""A greedy step's host pieces timed alone (timeit, 20,000 calls each), beside their in-engine times
(`phase_times.py`, `plan_greedy_lines.py`): `OMP_NUM_THREADS=1 PYTHONPATH=. python <this file>`."""

from __future__ import annotations

import timeit

import numpy as np

from backend.engine.page_table import PageTables

N = 20_000


def per_call_us(fn: object) -> float:
    return timeit.timeit(fn, number=N) / N * 1e6  # type: ignore[arg-type]


def main() -> None:
    tables = PageTables(num_rows=8, width=64)
    rows, lengths, num_pages = np.array([3]), np.array([10]), np.array([5])
    ids, pos = np.zeros((1, 5), np.int32), np.arange(4)[None]
    print("gather", per_call_us(lambda: tables.gather(rows, lengths, num_pages)), "us")
    print("np.array small", per_call_us(lambda: np.array([[5, 1, 2, 3]], dtype=np.int64)), "us")
    print("np.arange", per_call_us(lambda: np.arange(4)), "us")
    print("slots", per_call_us(lambda: ids[np.arange(1)[:, None], pos // 16] * np.int64(16) + pos % 16), "us")


if __name__ == "__main__":
    main()

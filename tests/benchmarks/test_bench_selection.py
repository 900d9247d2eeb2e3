"""`benchmarks/kernels/bench_selection.py --dry-run` on the CPU: both selection paths run through the
interpreter on the tiny cases and choose the same positions, the radix path's resident and streamed
kernels the same output (the GPU run times them)."""

from __future__ import annotations

import pytest

from benchmarks.kernels.bench_selection import main

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")


def test_dry_run_paths_agree() -> None:
    rows = main(["--dry-run"])
    assert len(rows) == 2 and all(r["same_set"] for r in rows)

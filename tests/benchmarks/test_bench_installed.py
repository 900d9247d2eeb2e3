"""`kumo bench` works from any directory, as installed (the benchmarks package ships with kumo)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path


def test_kumo_bench_runs_outside_the_checkout(tmp_path: Path) -> None:
    kumo = shutil.which("kumo", path=str(Path(sys.executable).parent))
    assert kumo is not None, "the kumo console script is not installed next to this Python"
    for command in (["bench", "--help"], ["bench", "serve", "--help"], ["bench", "load", "--help"]):
        r = subprocess.run([kumo, *command], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert "usage:" in r.stdout

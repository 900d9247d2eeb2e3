"""The tooling STYLE.md names, enforced by the suite: ruff's lint and formatter over the tree, mypy strict
on `schemas/` and `gateway/` (pyproject.toml holds their settings)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600
    )


@pytest.mark.parametrize("command", [("ruff", "check", "."), ("ruff", "format", "--check", ".")])
def test_ruff(command: tuple[str, ...]) -> None:
    done = _run(*command)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]


def test_mypy_strict_on_schemas_and_gateway() -> None:
    done = _run("mypy", "schemas", "gateway")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]

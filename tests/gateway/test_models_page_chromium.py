# ruff: noqa: F811  (pytest fixtures imported by name)
"""The `/models` page in a real browser: headless Chromium renders it (DOM dump and screenshot).
Skipped where Debian's `chromium` is not installed (`.ci/run` installs it)."""

from __future__ import annotations

import asyncio
import io
import shutil
from pathlib import Path

import pytest
from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)
from PIL import Image, ImageStat

from tests.child import dies_with_pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--no-first-run",
    "--hide-scrollbars",
]


async def chromium(*args: str, profile: Path) -> str:
    assert CHROMIUM is not None
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.DEVNULL, preexec_fn=dies_with_pytest(),
    )  # fmt: skip
    out, _ = await asyncio.wait_for(proc.communicate(), 90)
    assert proc.returncode == 0
    return out.decode()


async def test_page_renders_the_catalog_with_search_and_task_filter(harness: Harness, tmp_path: Path) -> None:
    dom = await chromium("--dump-dom", f"{harness.url}/models", profile=tmp_path / "p1")
    assert '<input type="search" name="search"' in dom and '<select name="task"' in dom
    assert f'data-name="{KIMI}"' in dom and f'data-name="{GLM}"' in dom
    assert "4096 tokens" in dom and '<p id="count">4 models</p>' in dom
    filtered = await chromium(
        "--dump-dom", f"{harness.url}/models?search=glm&task=Text+Generation", profile=tmp_path / "p2"
    )
    assert f'data-name="{GLM}"' in filtered and f'data-name="{KIMI}"' not in filtered
    assert '<option value="Text Generation" selected="">' in filtered
    shot = tmp_path / "models.png"
    await chromium(
        f"--screenshot={shot}", "--window-size=1000,800", f"{harness.url}/models", profile=tmp_path / "p3"
    )
    image = Image.open(io.BytesIO(shot.read_bytes())).convert("L")
    assert image.size == (1000, 800)
    assert ImageStat.Stat(image).stddev[0] > 10  # text was drawn, not a blank page

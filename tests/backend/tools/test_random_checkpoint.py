"""`kumo serve`'s first-start checkpoints are servable: they load, render their template, generate."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest
import torch

from backend.tools.random_checkpoint import make_random_checkpoint
from schemas.backend import Event, Finish, ModelCard, Usage
from tests.backend.server_checkpoints import TENANT, served

ROOT = Path(__file__).resolve().parents[3]
EXPECTED = {"kimi-k2.6": ("kimi", True), "glm-5.2": ("glm", False), "glm-4.5": ("glm", False)}


@pytest.mark.parametrize("kind", list(EXPECTED))
async def test_random_checkpoint_serves(tmp_path: Path, kind: str) -> None:
    path = make_random_checkpoint(kind, tmp_path / kind, dtype=torch.float32)
    async with served(path) as client:
        card = msgspec.json.decode((await client.get("/v1/model")).content, type=ModelCard)
        family, has_vision = EXPECTED[kind]
        assert (card.family, card.capabilities.vision) == (family, has_vision)
        assert card.capabilities.tools and card.capabilities.reasoning
        response = await client.post(
            "/v1/generate",
            json={
                "request_id": "r",
                "tenant_salt": TENANT,
                "messages": [{"role": "user", "content": "Hi"}],
                "sampling": {"max_tokens": 3, "temperature": 0.0},
            },
        )
        events = [msgspec.json.decode(line, type=Event) for line in response.text.splitlines()]
        assert isinstance(events[-2], Usage) and events[-2].completion_tokens == 3
        assert isinstance(events[-1], Finish) and events[-1].reason == "length"


def test_command_line_writes_whole_folder_once(tmp_path: Path) -> None:
    target = tmp_path / "models" / "glm"
    done = subprocess.run(
        [sys.executable, "-m", "backend.tools.random_checkpoint", "glm-4.5", str(target)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((target / "config.json").read_text())["architectures"] == ["Glm4MoeForCausalLM"]
    assert sorted(p.name for p in target.parent.iterdir()) == ["glm"]  # no staging folder left behind
    with pytest.raises(FileExistsError):
        make_random_checkpoint("glm-4.5", target)
    with pytest.raises(ValueError, match="unknown kind"):
        make_random_checkpoint("llama", tmp_path / "x")

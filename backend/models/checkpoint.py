"""Reading a Hugging Face checkpoint folder's safetensors, one tensor at a time.

A folder holds either `model.safetensors` or shards listed by `model.safetensors.index.json`
(`weight_map`: tensor name → shard file). Tensors are read lazily with `safe_open`, so loading
never holds more than one tensor beyond the model's own parameters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from backend.errors import CheckpointError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def shard_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint folder, in a stable order."""
    path = Path(path)
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as exc:
            raise CheckpointError(f"{index} has no valid weight_map") from exc
        files = [path / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.exists():
                raise CheckpointError(f"shard {f.name} named in {INDEX_FILE} is missing from {path}")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    raise CheckpointError(f"no {SINGLE_FILE} or {INDEX_FILE} in {path}")


def iter_tensors(
    path: str | Path, keep: Callable[[str], bool] | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every tensor of the checkpoint, reading one at a time.

    With `keep`, a tensor it refuses is never read (a rank skips the experts other ranks hold).
    """
    for file in shard_files(path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                if keep is None or keep(name):
                    yield name, f.get_tensor(name)

"""`make_random_checkpoint(kind, path)`: a servable small random checkpoint, for `kumo serve`'s first start.

Weights and config come from `backend.random_weights` (the published architecture, shrunk), the
tokenizer and chat template from `backend.tokenizer_files` (the family's real special tokens and
format). The folder appears whole or not at all: it is written beside its destination and renamed
into place, because `kumo serve` takes an existing `config.json` to mean "ready".

    python -m backend.random_checkpoint KIND PATH     # KIND: kimi-k2.6 | glm-5.2 | glm-4.5
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import torch

from backend.random_weights import KINDS, write_random_checkpoint


def make_random_checkpoint(
    kind: str, path: str | Path, *, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write the `kind` checkpoint at `path` (which must not exist yet) and return it."""
    if kind not in KINDS:
        raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
    target = Path(path)
    if target.exists():
        raise FileExistsError(f"{target} already exists")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        write_random_checkpoint(kind, staging, seed=seed, dtype=dtype)
        staging.rename(target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m backend.random_checkpoint",
        description="Write a small random checkpoint that a backend can serve.",
    )
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("path", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    args = parser.parse_args(argv)
    make_random_checkpoint(args.kind, args.path, seed=args.seed, dtype=getattr(torch, args.dtype))
    print(f"wrote a random {args.kind} checkpoint to {args.path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

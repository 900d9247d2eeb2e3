"""Shared by the quantization tests: one tiny Kimi-K2-shaped checkpoint, prompts, logit comparisons.

Tolerances, on the tiny random model (initializer 0.02, 40 random tokens, logits at every
position; relative L2 error, top-1 agreement): BF16 weights alone give 0.7% / 100%, the noise floor
of this model. Measured: INT4 g32 routed experts 2.7% / 97.5%; INT4 --all-linear 16% / 82% (random
Gaussian weights lose ~8% per weight at 4 bits, and 3 layers compound it); FP8 KV with calibrated
scales 1.3%, with scale 1.0 2.4%.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from backend.engine.prompt_runner import PromptRunner
from backend.models.loader import load_model
from tests.backend.tiny_checkpoints import make_tiny

IDS = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1)).tolist()


def make_src(path: Path) -> Path:
    """The tiny Kimi K2 checkpoint (small init: smooth enough that quantization error shows as
    small logit error), with a tokenizer_config.json to prove that non-weight files are copied."""
    path = make_tiny("kimi_k2", path, initializer_range=0.02)
    (path / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 128}))
    return path


def logits(path_or_model: Path | torch.nn.Module, **kw: object) -> torch.Tensor:
    """float32 logits [len(IDS), V] of a checkpoint folder or a loaded model, chunked prefill."""
    model = (
        load_model(path_or_model, dtype=torch.float32).model
        if isinstance(path_or_model, Path)
        else path_or_model
    )
    return PromptRunner(model, model_dtype=torch.float32, **kw).logits(IDS)  # type: ignore[arg-type]


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / a.norm())


def top1(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.argmax(-1) == b.argmax(-1)).float().mean())

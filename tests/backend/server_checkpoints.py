"""Test helper: tiny served checkpoints (transformers-written random weights + this family's tokenizer
and chat template), and an in-process backend over one."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from backend.server.app import build_backend, create_app
from backend.server.settings import build_settings
from backend.text.tokenizer import load_tokenizer
from backend.text.tokenizer_files import write_tokenizer_files
from tests.backend.tiny_checkpoints import make_tiny

SECRET = "test-secret-0123456789"
TENANT = "ab" * 16
FAMILY = {
    "kimi_k2": "kimi",
    "kimi_k25": "kimi",
    "deepseek_v3": "kimi",
    "glm_moe_dsa": "glm",
    "glm4_moe": "glm",
}


def make_served_checkpoint(arch: str, path: Path, *, context: int = 1024, **config_overrides: object) -> Path:
    """A tiny `arch` checkpoint that a backend can serve: vocab covering the tokenizer, the family's
    stop tokens as eos, a context long enough for templated prompts (`config_overrides` on top)."""
    family = FAMILY[arch]
    fmt = "tiktoken" if family == "kimi" else "tokenizer.json"
    generation = "4.5" if arch == "glm4_moe" else "5"
    num_ids = write_tokenizer_files(family, path, fmt=fmt, glm_generation=generation)  # type: ignore[arg-type]
    tok = load_tokenizer(path)
    eos = tok.named_id("eos_token")
    vocab = (num_ids + 63) // 64 * 64
    overrides: dict[str, object] = {
        "vocab_size": vocab,
        "max_position_embeddings": context,
        "eos_token_id": eos,
        "bos_token_id": tok.named_id("bos_token") or eos,
    }
    make_tiny(arch, path, **overrides, **config_overrides)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos]}))
    return path


@contextlib.asynccontextmanager
async def served(path: Path, *args: str) -> AsyncIterator[httpx.AsyncClient]:
    """An in-process backend over the checkpoint at `path` (float32, a small pool; `args` on top), and
    a client of it that sends the backend's secret."""
    settings = build_settings(
        ["--model", str(path), "--port", "0", "--dtype", "float32", "--max-pages", "32", *args],
        {"KUMO_BACKEND_SECRET": SECRET},
    )
    backend, engine = build_backend(settings)
    engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(backend))
        headers = {"authorization": f"Bearer {SECRET}"}
        async with httpx.AsyncClient(
            transport=transport, base_url="http://b", timeout=60, headers=headers
        ) as client:
            yield client
    finally:
        engine.stop()

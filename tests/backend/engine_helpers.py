"""Shared helpers for the engine tests: build an engine, make requests, run them to the end."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backend.engine.decode_graphs import Capture
from backend.engine.engine import Engine
from backend.engine.engine_config import EngineConfig
from schemas.backend import EngineOutput, EngineRequest, Error, FinishReason, SamplingParams, TokenLogprob
from tests.backend.engine_tiny_model import TinyPagedModel

TENANT_A = "a" * 32
TENANT_B = "b" * 32


MODELS = ("tiny", "deepseek_v3", "glm_moe_dsa", "glm4_moe")  # the test model, then real checkpoints


class ModelShelf:
    """The engine test model and the tiny real checkpoints of each family, built once on demand."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._models: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._models:
            self._models[name] = TinyPagedModel() if name == "tiny" else self._load(name)
        return self._models[name]

    def _load(self, arch: str) -> Any:
        from backend.models.loader import load_model
        from tests.backend.tiny_checkpoints import make_tiny

        return load_model(make_tiny(arch, self.root / arch), dtype=torch.float32)


def vocab_of(model: Any) -> int:
    return model.config.vocab_size if hasattr(model, "config") else model.vocab_size


def make_engine(
    model: Any = None, *, device: str = "cpu", graph_capture: Capture | None = None, **config: Any
) -> Engine:
    """An engine over the test model, or over a `LoadedModel` (real tiny checkpoint)."""
    model = model or TinyPagedModel().to(device)
    values = {"num_pages": 64, "max_num_batched_tokens": 64, "max_num_seqs": 16} | config
    if hasattr(model, "config"):
        from backend.models.loader import prepare_model

        engine_config = EngineConfig.build(**values)
        return Engine.from_prepared(
            prepare_model(model, engine_config), engine_config, graph_capture=graph_capture
        )
    return Engine(
        model,
        EngineConfig.build(**values),
        vocab_size=model.vocab_size,
        context_window=512,
        model_dtype=torch.float32,
        device=device,
        graph_capture=graph_capture,
    )


def request(request_id: str, prompt: list[int], *, tenant: str = TENANT_A, **sampling: Any) -> EngineRequest:
    sampling = {"temperature": 0.0, "max_tokens": 8} | sampling
    return EngineRequest(
        request_id=request_id,
        prompt_token_ids=prompt,
        tenant_salt=tenant,
        sampling=SamplingParams(**sampling),
    )


def prompt_of(seed: int, length: int, vocab: int = 97) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (length,), generator=g).tolist()


@dataclass
class Result:
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    error: Error | None = None
    num_cached_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    outputs: list[EngineOutput] = field(default_factory=list)


def collect(results: dict[str, Result], outputs: list[EngineOutput]) -> None:
    for out in outputs:
        r = results.setdefault(out.request_id, Result())
        r.outputs.append(out)
        r.token_ids += out.token_ids
        r.logprobs += out.logprobs or []
        if out.prompt_logprobs is not None:
            r.prompt_logprobs = out.prompt_logprobs
        r.num_cached_tokens = out.num_cached_tokens
        if out.finish_reason is not None:
            r.finish_reason, r.error = out.finish_reason, out.error


def run_all(engine: Engine, requests: list[EngineRequest], *, max_steps: int = 2000) -> dict[str, Result]:
    results: dict[str, Result] = {}
    for req in requests:
        engine.add_request(req)
    for _ in range(max_steps):
        if not engine.has_unfinished:
            return results
        collect(results, engine.step())
    raise AssertionError("requests did not finish")


def spy_tag_updates(engine: Engine) -> list[bool]:
    """A one-element list that says, after each `engine.step()`, whether that step carried page-tag
    updates (the block manager's `take_tag_updates`, wrapped)."""
    bm = engine.block_manager
    take = bm.take_tag_updates
    had_updates = [False]

    def taking() -> Any:
        updates = take()
        had_updates[0] = bool(updates)
        return updates

    bm.take_tag_updates = taking  # type: ignore[method-assign]
    return had_updates

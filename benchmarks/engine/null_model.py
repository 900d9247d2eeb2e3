"""Stand-ins for measuring the engine's host work: a forward that costs next to nothing, a wrapper
that times any model's forward so that it can be subtracted from a step's wall time, and a counter
of the aten ops dispatched outside that forward.

`NullModel` keeps the paged-model contract (cache specs, `forward(batch) -> [N, V]` logits) with one
table lookup: the logits of a row are a fixed random row picked by its input token, so greedy
decoding walks a seeded pseudo-random token chain, never stuck on one id. It reads no page and
writes no KV: every millisecond left in a step is the engine's, not the model's.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from backend.engine.forward_batch import CacheSpec, ForwardBatch


class NullModel(torch.nn.Module):
    def __init__(self, vocab_size: int = 128, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.vocab_size = vocab_size
        self.table = torch.nn.Parameter(torch.randn(vocab_size, vocab_size, generator=g), requires_grad=False)

    def cache_specs(self) -> list[list[CacheSpec]]:
        return [[CacheSpec("k", (1, 4))]]  # one small layer: the pool exists, costs nothing

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.table[batch.input_ids[batch.logits_indices]]  # [N, V]


class ForwardClock:
    """Where `TimedModel` keeps its time: a plain object, not Module attributes (whose `__setattr__`
    would cost more than the forward being timed)."""

    __slots__ = ("forward_s", "is_in_forward")

    def __init__(self) -> None:
        self.forward_s = 0.0
        self.is_in_forward = False  # read by op counters that must skip the model's own ops


class TimedModel(torch.nn.Module):
    """`inner` with its forward timed: `clock.forward_s` adds up the wall time spent inside it."""

    def __init__(self, inner: torch.nn.Module) -> None:
        super().__init__()
        self.inner = inner
        self.clock = ForwardClock()

    def cache_specs(self) -> list[list[CacheSpec]]:
        return self.inner.cache_specs()  # type: ignore[operator, no-any-return]

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        clock = self.clock
        clock.is_in_forward = True
        start = time.perf_counter()
        try:
            return self.inner.forward(batch)  # type: ignore[no-any-return]
        finally:
            clock.forward_s += time.perf_counter() - start
            clock.is_in_forward = False


class OpCounter(TorchDispatchMode):
    """Counts aten ops dispatched outside `model`'s forward (each is a launch or a copy on a GPU)."""

    def __init__(self, model: TimedModel) -> None:
        super().__init__()
        self.model = model
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not self.model.clock.is_in_forward:
            self.counts[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))

    def run(self, fn: Callable[[], Any]) -> Any:
        with self:
            return fn()

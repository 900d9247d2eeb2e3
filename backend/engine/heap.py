"""The garbage collector around a serving process's long-lived heap.

A backend's heap after start-up is large and lives as long as the process: the model, its loaders'
and kernels' modules, Triton's compiled kernels, the CUDA graphs' objects. CPython's collector still
scans all of it in every full (generation-2) collection, and the allocations of serving (sequences,
outputs, per-step dicts) trigger one now and then: a CPU engine's process alone holds ~170k objects
after start-up, and a full collection of them takes 30-45 ms, a pause in every running request's
stream. `freeze` moves what is alive once start-up is done into the
permanent generation (`gc.freeze`), which collections skip: a full collection then scans only what
serving allocated since. Garbage is still collected as before; only objects alive at the freeze
that later die in a reference cycle are kept until `thaw` (a process that builds several engines in
turn, a benchmark, thaws between them).

`Collections` counts the collections and their seconds by generation while it is open
(`gc.callbacks`), for benchmark records. On the H100 (2026-12-06, heap frozen) the engine benches'
slow runs (0.3-1 s more in a 0.3 s nano run; the integrity scenario's first run) had no full
collection but 3-26 young ones where others had 0-1: an allocation burst (compiling, capturing)
inside the run, not the collector; full collections there took 4-23 ms, once in ~6 runs.
"""

from __future__ import annotations

import gc
import time
from types import TracebackType
from typing import Any


def freeze() -> int:
    """Collect, then move every object still alive into the permanent generation; how many."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def thaw() -> None:
    """Undo `freeze` (objects frozen become collectable again), then collect."""
    gc.unfreeze()
    gc.collect()


class Collections:
    """Collections while open, by generation: how many and their seconds (`summary`)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.seconds = [0.0, 0.0, 0.0]
        self._start = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start = time.perf_counter()
            return
        generation = int(info["generation"])
        self.count[generation] += 1
        self.seconds[generation] += time.perf_counter() - self._start

    def __enter__(self) -> Collections:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, Any]:
        """{"full": count, "full_ms": ms, "young": count, "young_ms": ms}: generation 2, then 0 and 1."""
        return {
            "full": self.count[2],
            "full_ms": round(self.seconds[2] * 1e3, 2),
            "young": self.count[0] + self.count[1],
            "young_ms": round((self.seconds[0] + self.seconds[1]) * 1e3, 2),
        }

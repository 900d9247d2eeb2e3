"""The scope of a forward that must not wait on the device: a CUDA-graph capture and its warm-up.

A layer whose usual path sizes its work from device values (`torch.unique(...).tolist()` to loop
over the experts in use) takes a fixed-shape path inside `sync_free()` instead. `backend.engine.decode_graphs`
enters it around every captured decode step (and its sync-checked warm-up), so the warm-up runs the
very Python path the graph records. A context variable, not a flag on a module: it belongs to the
thread (and task) that entered it, and leaves with the `with` block.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

_SYNC_FREE: ContextVar[bool] = ContextVar("sync_free", default=False)


@contextmanager
def sync_free() -> Iterator[None]:
    token = _SYNC_FREE.set(True)
    try:
        yield
    finally:
        _SYNC_FREE.reset(token)


def is_sync_free() -> bool:
    return _SYNC_FREE.get()

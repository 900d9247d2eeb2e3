"""A loaded Python Worker: its module, the `env` it sees, and how one request reaches its handler.

Two handler shapes exist in the wild and both are served:

    class Default(WorkerEntrypoint):          # current SDK: one instance per request, (ctx, env)
        async def fetch(self, request): ...
    async def on_fetch(request, env[, ctx])   # the older module-level handler
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from wrangler_mock import shims
from wrangler_mock.errors import WorkerLoadError
from wrangler_mock.jsvalue import JsObject, from_json
from wrangler_mock.request import Request
from wrangler_mock.response import Response
from wrangler_mock.shims.workers import WorkerEntrypoint


class Env(JsObject):
    """`env`: bindings and vars by name (`env.AI`, `env.GREETING`, `env["GREETING"]`)."""

    @classmethod
    def build(cls, vars: dict[str, Any], bindings: dict[str, Any]) -> Env:
        # string vars stay strings; TOML tables and arrays arrive as JSON values, as in wrangler
        return cls({**{k: from_json(v) for k, v in vars.items()}, **bindings})


@dataclass
class ExecutionContext:
    """`ctx`: `waitUntil` keeps background work alive after the response, as the runtime does."""

    pending: set[asyncio.Task[Any]] = field(default_factory=set)

    def waitUntil(self, awaitable: Awaitable[Any]) -> None:  # noqa: N802  (the runtime's name)
        task = asyncio.ensure_future(awaitable)
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    wait_until = waitUntil

    def passThroughOnException(self) -> None:  # noqa: N802
        """There is no origin behind a local Worker to fall through to; errors still become a 500."""

    async def drain(self) -> None:
        if self.pending:
            await asyncio.gather(*self.pending, return_exceptions=True)


@dataclass(frozen=True)
class Worker:
    """A Worker module and the callable that turns (request, env, ctx) into its response."""

    module: ModuleType
    handle: Callable[[Request, Env, ExecutionContext], Awaitable[Any]]

    @classmethod
    def load(cls, main: Path) -> Worker:
        """Import `main` as the runtime would: shims installed, its folder importable for siblings."""
        if not main.is_file():
            raise WorkerLoadError(f"the Worker's main module {main} does not exist")
        shims.install()
        folder = str(main.parent)
        if folder not in sys.path:
            sys.path.insert(0, folder)
        spec = importlib.util.spec_from_file_location(main.stem, main)
        if spec is None or spec.loader is None:
            raise WorkerLoadError(f"cannot import {main}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[main.stem] = module
        try:
            spec.loader.exec_module(module)
        except Exception as exc:
            raise WorkerLoadError(f"importing {main} failed: {type(exc).__name__}: {exc}") from exc
        return cls(module, _handler_of(module, main))

    async def fetch(self, request: Request, env: Env, ctx: ExecutionContext) -> Response:
        result = await self.handle(request, env, ctx)
        if not isinstance(result, Response):
            raise TypeError(f"the Worker's fetch handler returned {type(result).__name__}, not a Response")
        return result


SKIPPED_FOLDERS = {"__pycache__", "node_modules", "venv", "site-packages"}


def source_stamp(folder: Path) -> dict[str, int]:
    """Modification times of the Python files under `folder` (hidden and dependency folders skipped)."""
    stamp: dict[str, int] = {}
    for root, folders, files in os.walk(folder):
        folders[:] = [f for f in folders if not f.startswith(".") and f not in SKIPPED_FOLDERS]
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                with contextlib.suppress(OSError):
                    stamp[path] = os.stat(path).st_mtime_ns
    return stamp


@dataclass
class LiveWorker:
    """The Worker, imported again when a Python file beside it changes, as `wrangler dev` reloads.

    Modules imported from the Worker's folder are forgotten first, so an edited helper module is
    re-imported too. A broken edit raises `WorkerLoadError` on every request until it is fixed.
    """

    main: Path
    worker: Worker | None = None
    error: WorkerLoadError | None = None
    stamp: dict[str, int] = field(default_factory=dict)

    @classmethod
    def load(cls, main: Path) -> LiveWorker:
        return cls(main, Worker.load(main), stamp=source_stamp(main.parent))

    def current(self) -> Worker:
        stamp = source_stamp(self.main.parent)
        if stamp != self.stamp:
            self.stamp = stamp
            _forget_modules_under(self.main.parent)
            try:
                self.worker, self.error = Worker.load(self.main), None
            except WorkerLoadError as exc:
                self.worker, self.error = None, exc
        if self.error is not None:
            raise self.error
        assert self.worker is not None
        return self.worker


_OWN_FOLDER = str(Path(__file__).resolve().parent) + os.sep  # wrangler_mock itself, shims included


def _forget_modules_under(folder: Path) -> None:
    """Drop the Worker's own modules from sys.modules; never wrangler-mock's (class identity matters)."""
    prefix = str(folder.resolve()) + os.sep
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if not file:
            continue
        path = str(Path(file).resolve())
        if path.startswith(prefix) and not path.startswith(_OWN_FOLDER):
            del sys.modules[name]


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


def _handler_of(module: ModuleType, main: Path) -> Callable[[Request, Env, ExecutionContext], Awaitable[Any]]:
    entrypoint = getattr(module, "Default", None)
    if inspect.isclass(entrypoint) and callable(getattr(entrypoint, "fetch", None)):

        async def call_entrypoint(request: Request, env: Env, ctx: ExecutionContext) -> Any:
            instance: Any = entrypoint(ctx, env) if issubclass(entrypoint, WorkerEntrypoint) else entrypoint()
            return await _maybe_await(instance.fetch(request))

        return call_entrypoint
    on_fetch = getattr(module, "on_fetch", None)
    if callable(on_fetch):
        num_params = len(inspect.signature(on_fetch).parameters)

        async def call_on_fetch(request: Request, env: Env, ctx: ExecutionContext) -> Any:
            args = (request, env, ctx)[: max(1, min(num_params, 3))]
            return await _maybe_await(on_fetch(*args))

        return call_on_fetch
    raise WorkerLoadError(
        f"{main} has no fetch handler: define `class Default(WorkerEntrypoint)` with `async def fetch(self, request)`"
        " or `async def on_fetch(request, env)`"
    )

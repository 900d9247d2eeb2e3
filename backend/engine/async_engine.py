"""The engine on its own thread (`AsyncEngine`): a server's event loop hands it requests and awaits
their outputs, and never waits on a step (DESIGN.md §3: a closed connection aborts within one step).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import threading
from collections.abc import AsyncGenerator, Callable
from typing import Any

import msgspec
import torch

from backend.engine.constraint import TokenConstraint
from backend.engine.engine import Engine
from backend.errors import Aborted, EngineError, InvalidRequest
from schemas.backend import EngineOutput, EngineRequest, LoadReport

log = logging.getLogger("kumo.engine")


class AsyncEngine:
    """The `Engine` on its own thread, so a server's event loop never waits on a step.

    Adds and aborts are queued to the engine thread and applied between steps; outputs come back
    to each caller's event loop. Leaving `generate` early (client gone) aborts the request, which
    frees its pages within one step.

    The engine knows each stream by its own id (`<request id>#<n>`): a stream that left is aborted
    only at the next step, and its outputs until then must not reach a new stream that reuses the
    caller's request id (a retry), nor may that stream be refused as a duplicate.
    """

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._commands: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}  # by engine id
        self._engine_ids: dict[str, str] = {}  # caller's request id -> engine id of its live stream
        self._stream_numbers = itertools.count()
        self._thread: threading.Thread | None = None
        self._is_stopping = False
        self._is_dead = False  # the thread died of a bug: every stream ended, new ones refused
        # called (from the dying thread) once it has died: the backend's `main` exits, so that its
        # supervisor starts it again (backend/server/rank_group.py `RankFailure`)
        self.on_death: Callable[[str], None] | None = None
        self._load = engine.load()

    def start(self) -> None:
        self._is_stopping = False
        self._is_dead = False
        self._thread = threading.Thread(target=self._run, name="kumo-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._lock:  # from here on `_submit` refuses adds; the thread aborts those it left queued
            self._is_stopping = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def load(self) -> LoadReport:
        """The engine's load as of its last step (read without waiting for the engine thread)."""
        return self._load

    @property
    def is_alive(self) -> bool:
        """False once the engine thread has died (`/v1/health` then says so: the gateway ejects the
        replica rather than send it requests no thread will ever step)."""
        return not self._is_dead and (self._thread is None or self._thread.is_alive())

    async def generate(
        self,
        request: EngineRequest,
        *,
        constraint: TokenConstraint | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> AsyncGenerator[EngineOutput, None]:
        """Outputs of `request` as the engine produces them; raises the `EngineError` refusing it."""
        request_id = request.request_id
        if request_id in self._engine_ids:  # two live streams under one id could not be told apart
            raise InvalidRequest(f"Request id {request_id!r} is already streaming.")
        engine_id = f"{request_id}#{next(self._stream_numbers)}"
        queue: asyncio.Queue[Any] = asyncio.Queue()
        self._engine_ids[request_id] = engine_id
        self._streams[engine_id] = (asyncio.get_running_loop(), queue)
        self._submit(
            ("add", msgspec.structs.replace(request, request_id=engine_id), constraint, image_embeds)
        )
        is_done = False
        try:
            while not is_done:
                item = await queue.get()
                if isinstance(item, EngineError):
                    is_done = True
                    raise item
                is_done = item.finish_reason is not None
                item.request_id = request_id
                yield item
        finally:
            self._streams.pop(engine_id, None)
            self._engine_ids.pop(request_id, None)
            if not is_done:
                self._submit(("abort", engine_id))

    def abort(self, request_id: str) -> None:
        """Abort the live stream of the caller's `request_id`, if there is one."""
        engine_id = self._engine_ids.get(request_id)
        if engine_id is not None:
            self._submit(("abort", engine_id))

    def fail_streams(self, error: EngineError) -> None:
        """End every live stream with `error` now, from any thread (the engine thread may be stuck
        in a collective with a rank that died)."""
        event = error.to_event()
        self._deliver_all(
            [(i, EngineOutput(request_id=i, finish_reason="abort", error=event)) for i in list(self._streams)]
        )

    def _submit(self, command: tuple[Any, ...]) -> None:
        with self._lock:
            is_refused = (self._is_stopping or self._is_dead) and command[0] == "add"
            if not is_refused and not self._is_dead:  # no thread takes an abort either: nothing to end
                self._commands.append(command)
        if is_refused:  # no engine thread will ever take it: answer now rather than hang the caller
            reason = "has failed" if self._is_dead else "is shutting down"
            self._deliver(command[1].request_id, Aborted(f"The engine {reason}."))
            return
        self._wake.set()

    def _deliver(self, engine_id: str, item: EngineOutput | EngineError) -> None:
        self._deliver_all([(engine_id, item)])

    def _deliver_all(self, items: list[tuple[str, EngineOutput | EngineError]]) -> None:
        """Hand each item to its stream's queue, waking each event loop once for all of them (every
        `call_soon_threadsafe` writes to the loop's wake-up pipe: one per output was a system call
        per sequence per step)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[str, asyncio.Queue[Any], Any]]] = {}
        for engine_id, item in items:
            stream = self._streams.get(engine_id)
            if stream is not None:
                by_loop.setdefault(stream[0], []).append((engine_id, stream[1], item))
        for loop, batch in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, batch)
            except RuntimeError:  # its event loop is closed: no one will read these streams, so end them
                for engine_id, _, _ in batch:
                    self._streams.pop(engine_id, None)
                    self._submit(("abort", engine_id))

    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # a bug outside a step: every caller answered, none left waiting
            log.exception("the engine thread died")
            with self._lock:
                self._is_dead = True
                commands, self._commands = self._commands, []
            self.fail_streams(EngineError(f"The engine thread died: {exc!r}"))
            for command in commands:
                if command[0] == "add":
                    self._deliver(command[1].request_id, Aborted("The engine has failed."))
            if self.on_death is not None:
                self.on_death(f"the engine thread died: {exc!r}")

    def _serve(self) -> None:
        while not self._is_stopping:
            with self._lock:
                commands, self._commands = self._commands, []
            for command in commands:
                if command[0] == "abort":
                    try:
                        self.engine.abort(command[1])
                    except Exception:  # a bug in one abort: the others, and the steps, go on
                        log.exception("aborting request %s failed", command[1])
                    continue
                _, request, constraint, image_embeds = command
                try:
                    self.engine.add_request(request, constraint=constraint, image_embeds=image_embeds)
                except EngineError as exc:
                    self._deliver(request.request_id, exc)
                except Exception as exc:  # a bug refuses this request; the thread serves the others
                    log.exception("adding request %s failed", request.request_id)
                    self._deliver(request.request_id, EngineError(f"internal error: {exc!r}"))
            if not self.engine.has_unfinished:
                self._load = self.engine.load()
                if not self._wake.wait(self.engine.keep_alive_in):  # idle this long, with other ranks
                    with contextlib.suppress(EngineError):  # RanksDown: their failure is handled already
                        self.engine.keep_alive()
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except EngineError as exc:  # RanksDown: a rank of the group failed (retryable)
                outputs = self.engine.fail_all(exc)
            except Exception as exc:  # fail every request rather than leave them hanging
                log.exception("engine step failed")
                outputs = self.engine.fail_all(EngineError(f"The engine step failed: {exc!r}"))
            self._load = self.engine.load()  # before delivering: a finished client sees its pages back
            self._deliver_all([(out.request_id, out) for out in outputs])
        self._deliver_all(
            [(o.request_id, o) for o in self.engine.fail_all(Aborted("The engine is shutting down."))]
        )
        with self._lock:
            commands, self._commands = self._commands, []
        for command in commands:
            if command[0] == "add":
                self._deliver(command[1].request_id, Aborted("The engine is shutting down."))


def _put_all(batch: list[tuple[str, asyncio.Queue[Any], Any]]) -> None:
    """On the event loop: one step's items, in order, into their streams' queues."""
    for _, queue, item in batch:
        queue.put_nowait(item)

"""`kumo serve`'s backend processes: restarted when they die, and never outliving `kumo serve`.

A backend that exits while `kumo serve` runs is started again after a backoff (1 s, doubling to
30 s; back to 1 s once a process has stayed up for a minute); a start that fails (its port taken,
no process could be forked) is tried again after the next backoff. Meanwhile the router ejects the dead
replica, so its requests get 503/3040 with `Retry-After`; the health loop brings it back when the
new process is ready.

Each child asks the kernel for SIGKILL when its parent dies (`prctl(PR_SET_PDEATHSIG)`), so even a
`kumo serve` killed with SIGKILL leaves no backend behind (`schemas.child_process.die_with_parent`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import structlog

log = structlog.get_logger("kumo.supervisor")


class Supervised(Protocol):
    name: str
    process: asyncio.subprocess.Process | None


class Supervisor:
    """Watches processes and restarts any that exits, until `stop()`."""

    def __init__(
        self,
        children: Sequence[Supervised],
        restart: Callable[[Supervised], Awaitable[None]],
        *,
        on_exit: Callable[[Supervised], None] | None = None,
        first_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_after_s: float = 60.0,
    ) -> None:
        """`on_exit(child)`: called the moment a child's exit is seen, before the backoff (`kumo serve`
        binds the backend's port again there, so nothing takes it meanwhile); an OSError it raises is
        logged, and the restart does without."""
        self._children = list(children)
        self._restart = restart
        self._on_exit = on_exit
        self._first, self._max, self._stable = first_backoff_s, max_backoff_s, stable_after_s
        self._tasks: list[asyncio.Task[None]] = []
        self.num_restarts = 0

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._watch(c), name=f"kumo-watch-{c.name}") for c in self._children
        ]

    async def stop(self) -> None:
        """Stop watching (before the children are stopped on purpose)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks = []

    async def _watch(self, child: Supervised) -> None:
        loop = asyncio.get_running_loop()
        backoff = self._first
        while True:
            assert child.process is not None
            started = loop.time()
            code = await child.process.wait()
            if loop.time() - started >= self._stable:
                backoff = self._first
            log.warning("backend_exited", model=child.name, code=code, restart_in_s=backoff)
            if self._on_exit is not None:
                try:
                    self._on_exit(child)
                except OSError as exc:
                    log.error("backend_exit_hook_failed", model=child.name, error=str(exc))
            while True:  # until a start succeeds: each failed one waits the next backoff
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, self._max)
                try:
                    await self._restart(child)
                    break
                except Exception as exc:  # its port taken, no process forked, no thread to watch it
                    log.error("backend_restart_failed", model=child.name, error=repr(exc), retry_in_s=backoff)
            self.num_restarts += 1
            log.info("backend_restarted", model=child.name, pid=child.process.pid if child.process else None)

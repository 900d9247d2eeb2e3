"""The tests' long-lived child processes (backends, `kumo serve`, wrangler-mock, chromium) die with
the pytest process that started them, even when CI kills it with SIGKILL mid-run: a survivor kept
its port and its CPU, and slowed or broke the next run on the same machine."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable

from schemas.child_process import die_with_parent


def dies_with_pytest() -> Callable[[], None]:
    """A `preexec_fn` (subprocess.Popen, asyncio.create_subprocess_exec) for a child of this process."""
    return functools.partial(die_with_parent, os.getpid())

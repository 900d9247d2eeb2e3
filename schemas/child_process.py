"""A child process that never outlives its parent: `kumo serve`'s backends (gateway/serve.py), a
backend's ranks 1..N−1 (backend/server/rank_group.py) and the benchmark's follower ranks. Here, in
the package both sides share, so the backend never imports the gateway; standard library only."""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1


# resolved in the parent, at import: a `dlopen` between fork and exec, in a child of a process with
# threads, can wait forever on a loader lock another thread held at the fork
_PRCTL = ctypes.CDLL(None, use_errno=True).prctl if sys.platform.startswith("linux") else None


def die_with_parent(parent_pid: int) -> None:
    """A `preexec_fn`: SIGKILL this child when the process that spawned it exits. Linux only; a
    no-op elsewhere. If the parent is already gone (it died between fork and here), exit now."""
    if _PRCTL is None:
        return
    if _PRCTL(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(70)  # the guarantee cannot be given: refuse to run without it
    if os.getppid() != parent_pid:
        os._exit(0)

"""`tests/child.py`: a test's child process does not outlive a pytest killed with SIGKILL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# a stand-in for pytest: starts a long child the way the fixtures do, prints its pid, waits
PARENT = """
import subprocess, sys, time
from tests.child import dies_with_pytest
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], preexec_fn=dies_with_pytest())
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not yet reaped by init) is gone
        return f.read().split(") ")[1].split()[0] != "Z"


def test_a_child_dies_when_pytest_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    parent.stdout.close()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(child)

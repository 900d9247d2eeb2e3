"""What the gateway benchmarks (`kumo bench load`, `kumo bench serve`) share on the client side: the
SSE reader, the percentile, and the description of the machine a result was measured on."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import IO, Any

import httpx

DONE = "[DONE]"


async def sse_data(response: httpx.Response) -> AsyncIterator[str]:
    """The payload of each `data: ` line of a streaming response, `[DONE]` included, as it arrives."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            yield line[len("data: ") :]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank `q` quantile (0..1) of `values`; NaN when there are none."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def machine(note: str = "") -> dict[str, object]:
    """This machine: CPU model and count, Python, host, and what the caller adds (`note`)."""
    model = ""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        model = next(
            (
                ln.split(":", 1)[1].strip()
                for ln in cpuinfo.read_text().splitlines()
                if ln.startswith("model name")
            ),
            "",
        )
    described: dict[str, object] = {
        "cpu": model or platform.processor() or platform.machine(),
        "num_cpus": os.cpu_count(),
        "python": platform.python_version(),
        "host": platform.node(),
    }
    return described | ({"note": note} if note else {})


def spawn_serve(
    args: list[str],
    *,
    env: dict[str, str],
    stderr: IO[Any] | int | None,
    cwd: Path | None = None,
    timeout_s: float = 600,
    new_session: bool = False,
) -> tuple[subprocess.Popen[str], str]:
    """`kumo serve ARGS` in a subprocess, returned with what it printed up to its announcement (the URL,
    account id and token). A thread keeps reading its stdout afterwards, so the pipe never fills.
    RuntimeError (the process killed) if it exits or has not announced itself within `timeout_s`.
    `new_session`: its own process group, as a terminal's foreground job (Ctrl-C is `killpg` SIGINT)."""
    process = subprocess.Popen(
        [sys.executable, "-m", "gateway.cli", "serve", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
        stderr=stderr, text=True, start_new_session=new_session,
    )  # fmt: skip
    printed: list[str] = []
    ready = threading.Event()

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            printed.append(line)
            if "API token:" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not ready.wait(0.2):
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("kumo serve did not start:\n" + "".join(printed))
    return process, "".join(printed)

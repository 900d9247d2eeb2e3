"""Test helper: one `kumo backend` process on a tiny GLM-5 checkpoint for the whole test session."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.backend.server_checkpoints import SECRET, make_served_checkpoint
from tests.child import dies_with_pytest

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class RunningBackend:
    url: str
    model_dir: Path
    num_pages: int
    process: subprocess.Popen[bytes]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_backend(
    tmp_path_factory: pytest.TempPathFactory,
    *,
    model_dir: Path | None = None,
    extra_args: tuple[str, ...] = (),
) -> Iterator[RunningBackend]:
    """Start the backend, yield it, stop it (wrap in a session-scoped fixture: one per session).
    `model_dir`: a served checkpoint (default: a tiny GLM-5); `extra_args`: more command-line flags."""
    if model_dir is None:
        model_dir = make_served_checkpoint("glm_moe_dsa", tmp_path_factory.mktemp("served-glm5"))
    port, num_pages = _free_port(), 96
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), KUMO_BACKEND_SECRET=SECRET)
    log_path = tmp_path_factory.getbasetemp() / f"backend-{port}.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "gateway.cli",
            "backend",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--dtype",
            "float32",
            "--max-pages",
            str(num_pages),
            "--page-size",
            "8",
            "--max-num-seqs",
            "64",
            "--name",
            "glm-5.2-tiny",
            *extra_args,
        ],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        preexec_fn=dies_with_pytest(),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError("backend did not start: " + log_path.read_text())
        time.sleep(0.2)
    yield RunningBackend(url, model_dir, num_pages, process)
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    log.close()

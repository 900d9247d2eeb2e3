# ruff: noqa: F811  (pytest fixtures imported by name)
"""`kumo serve` supervises its backends: a real backend killed with SIGKILL is restarted, and
meanwhile its model's requests get 503/3040 with `Retry-After` (never a hang or a bare 500)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from benchmarks.client import spawn_serve
from tests.child import dies_with_pytest
from tests.e2e.serve_process import LEGACY, ROOT, Kumo, _children

pytestmark = pytest.mark.slow


def _cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    except OSError:
        return []


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def backend_pid(kumo: Kumo, model: str) -> int:
    """The `kumo backend` serving `model` under this session's `kumo serve`."""
    for entry in Path("/proc").glob("[0-9]*"):
        pid = int(entry.name)
        args = _cmdline(pid)
        if "backend" in args and model in args:
            with_parent = _cmdline(_ppid(pid))
            if str(kumo.data_dir) in with_parent:
                return pid
    raise AssertionError(f"no backend process for {model}")


def test_a_killed_backend_is_restarted_and_meanwhile_503(kumo: Kumo) -> None:
    run = kumo.path(f"/ai/run/{LEGACY}")
    body = {"prompt": "Hello", "max_tokens": 2}
    assert httpx.post(run, headers=kumo.auth, json=body, timeout=60).status_code == 200
    old = backend_pid(kumo, LEGACY)
    os.kill(old, signal.SIGKILL)
    r = httpx.post(run, headers=kumo.auth, json=body, timeout=60)
    assert r.status_code == 503, r.text
    assert r.json()["errors"][0]["code"] == 3040 and r.json()["success"] is False
    assert int(r.headers["retry-after"]) >= 1 and r.headers["x-should-retry"] == "true"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        r = httpx.post(run, headers=kumo.auth, json=body, timeout=60)
        if r.status_code == 200:
            break
        assert r.status_code == 503, r.text  # nothing but "come back later" while it restarts
        time.sleep(0.5)
    assert r.status_code == 200, r.text
    assert backend_pid(kumo, LEGACY) != old
    # its port bound again the moment it died (past its closed connections' TIME_WAIT), and the first
    # start after the backoff took it (tests/gateway/test_ports.py)
    log = (kumo.data_dir / "serve.log").read_text()
    assert "backend_exit_hook_failed" not in log and "backend_restart_failed" not in log, log[-3000:]


def test_ctrl_c_stops_serve_and_its_backends_without_tracebacks(tmp_path: Path) -> None:
    # A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the backends must not get
    # it (each would log a KeyboardInterrupt traceback); `kumo serve` stops them itself.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("KUMO_ADMIN_TOKEN", None)
    with (tmp_path / "serve.log").open("wb") as log:
        process, _ = spawn_serve(
            ["--port", "0", "--data-dir", str(tmp_path)],
            cwd=ROOT, env=env, stderr=log, timeout_s=300, new_session=True,
        )  # fmt: skip
        try:
            children = _children(process.pid)
            assert len(children) == 2  # GLM 5.2 and Kimi K2.6
            os.killpg(process.pid, signal.SIGINT)
            assert process.wait(timeout=60) == 0
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "backends outlived kumo serve"
    logs = sorted((tmp_path / "logs").glob("*.log"))
    assert {p.name for p in logs} >= {"glm-5.2.log", "kimi-k2.6.log"}
    for path in [*logs, tmp_path / "serve.log"]:
        assert "Traceback" not in path.read_text(), path.read_text()


def test_a_ctrl_c_before_the_server_runs_is_not_lost(tmp_path: Path) -> None:
    """SIGINT after the backends are ready, before uvicorn's handlers are in (sigint_hook: the moment
    the store is open): `kumo serve` stops, its backends with it, rather than serve on with the
    signal swallowed (2026-12-06: it did)."""
    env = dict(
        os.environ, OMP_NUM_THREADS="1", PYTHONPATH=f"{ROOT / 'tests/e2e/sigint_hook'}{os.pathsep}{ROOT}"
    )
    env.pop("KUMO_ADMIN_TOKEN", None)
    with (tmp_path / "serve.log").open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--port", "0", "--data-dir", str(tmp_path)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=log, start_new_session=True,
            preexec_fn=dies_with_pytest(),
        )  # fmt: skip
        try:
            out, _ = process.communicate(timeout=150)  # ready in ~15 s here; swallowed: it serves on
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()
    assert process.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
    assert b"Kumo is ready" not in out  # stopped before it announced anything
    assert "Traceback" not in (tmp_path / "serve.log").read_text()

"""`kumo backend --tp 2 --device cpu` through its HTTP API: the same greedy text and logprobs as
`--tp 1` for each architecture, the parallel layout in `/v1/model`, pools idle after disconnects,
and a killed rank: the requests in flight end with a retryable error, the backend exits, and the
supervisor that `kumo serve` runs (`gateway.serve.start_backend` + `Supervisor`) starts the whole
rank group again, which serves again.
"""

from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from backend.server.rank_group import RANKS_DOWN_EXIT
from gateway.serve import BackendProcess, start_backend
from gateway.supervisor import Supervisor
from schemas.backend import Error, ErrorBody, Event, Finish, LoadReport, ModelCard, TextDelta
from tests.backend.server_checkpoints import SECRET, make_served_checkpoint
from tests.backend.server_process import _free_port

pytestmark = pytest.mark.slow  # real `kumo backend --tp 2` processes: `make test-fast` leaves them out

ROOT = Path(__file__).resolve().parents[3]
AUTH = {"authorization": f"Bearer {SECRET}"}
_events = msgspec.json.Decoder(Event)


def _children(pid: int) -> list[int]:
    """The rank processes (`python -m backend.server.rank_group`) that `pid` started."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if ppid == pid and b"backend.server.rank_group" in cmdline:
            found.append(int(stat.parent.name))
    return found


def _wait_healthy(
    url: str, process: subprocess.Popen[bytes] | None, log: Path, timeout_s: float = 120
) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/v1/health", timeout=1).json()["status"] == "ok":
                return
        except (httpx.TransportError, ValueError):
            pass
        if (process is not None and process.poll() is not None) or time.monotonic() > deadline:
            raise RuntimeError("backend did not start: " + log.read_text())
        time.sleep(0.2)


class Backend:
    def __init__(self, model: Path, tmp: Path, *args: str) -> None:
        self.url = f"http://127.0.0.1:{(port := _free_port())}"
        self.log = tmp / f"backend-{port}.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), KUMO_BACKEND_SECRET=SECRET)
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "backend", "--model", str(model), "--port", str(port),
                 "--dtype", "float32", "--max-pages", "64", "--page-size", "8", "--device", "cpu", *args],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
            )  # fmt: skip
        _wait_healthy(self.url, self.process, self.log)

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def _generate(url: str, request_id: str, prompt: str | bytes, **sampling: object) -> list[Event]:
    """A raw prompt, or a chat message with one image (PNG bytes)."""
    payload: dict[str, object] = {
        "request_id": request_id,
        "tenant_salt": "a" * 32,
        "sampling": {"temperature": 0, "max_tokens": 8, "logprobs": True, "top_logprobs": 2} | sampling,
    }
    if isinstance(prompt, bytes):
        image = {"type": "image", "data": base64.b64encode(prompt).decode()}
        payload["messages"] = [{"role": "user", "content": [{"type": "text", "text": "Describe"}, image]}]
        payload["reasoning"] = {"enabled": False}
    else:
        payload |= {"prompt": prompt, "raw": True}
    response = httpx.post(f"{url}/v1/generate", json=payload, headers=AUTH, timeout=120)
    assert response.status_code == 200, response.text
    return [_events.decode(line) for line in response.text.splitlines() if line]


def _text_and_logprobs(events: list[Event]) -> tuple[str, list[int], list[float]]:
    text, ids, logprobs = "", [], []
    for e in events:
        if isinstance(e, TextDelta):
            text += e.text
            for lp in e.logprobs or []:
                ids.append(lp.token_id)
                logprobs.append(lp.logprob)
    assert isinstance(events[-1], Finish), events
    return text, ids, logprobs


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


PROMPTS = ["The capital of France", "hello world, once more", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15"]


@pytest.fixture
def backends() -> Iterator[list[Backend]]:
    started: list[Backend] = []
    yield started
    for b in started:
        b.stop()


@pytest.mark.parametrize(
    ("arch", "args"),
    [
        ("deepseek_v3", ("--tp", "2")),
        ("deepseek_v3", ("--tp", "2", "--dcp", "2")),
        ("glm_moe_dsa", ("--tp", "2", "--ep", "1")),
        ("glm4_moe", ("--tp", "2")),
        ("kimi_k25", ("--tp", "2")),
    ],
)
def test_two_ranks_answer_what_one_answers(
    arch: str, args: tuple[str, ...], tmp_path: Path, backends: list[Backend]
) -> None:
    model = make_served_checkpoint(arch, tmp_path / arch)
    one = Backend(model, tmp_path)
    backends.append(one)
    two = Backend(model, tmp_path, *args)
    backends.append(two)
    prompts: list[str | bytes] = [*PROMPTS, _png(70, 56, 1)] if arch == "kimi_k25" else [*PROMPTS]
    for i, prompt in enumerate(prompts):
        e_text, e_ids, e_logprobs = _text_and_logprobs(_generate(one.url, f"r{i}", prompt))
        g_text, g_ids, g_logprobs = _text_and_logprobs(_generate(two.url, f"r{i}", prompt))
        assert g_ids == e_ids and g_text == e_text and len(e_ids) == 8
        assert g_logprobs == pytest.approx(e_logprobs, abs=1e-5)
    card = msgspec.json.decode(httpx.get(f"{two.url}/v1/model", headers=AUTH).content, type=ModelCard)
    named = dict(zip(args[::2], args[1::2], strict=True))
    assert (card.tp, card.ep, card.dcp) == (2, int(named.get("--ep", 2)), int(named.get("--dcp", 1)))
    assert len(_children(two.process.pid)) == 1  # rank 1


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_gpus_answer_what_one_answers(tmp_path: Path, backends: list[Backend]) -> None:
    """NCCL, one process per GPU (cuda:0 and cuda:1), against one GPU."""
    model = make_served_checkpoint("deepseek_v3", tmp_path / "ds")
    one = Backend(model, tmp_path, "--device", "cuda")
    backends.append(one)
    two = Backend(model, tmp_path, "--device", "cuda", "--tp", "2")
    backends.append(two)
    for i, prompt in enumerate(PROMPTS):
        e_text, e_ids, e_logprobs = _text_and_logprobs(_generate(one.url, f"r{i}", prompt))
        g_text, g_ids, g_logprobs = _text_and_logprobs(_generate(two.url, f"r{i}", prompt))
        assert g_ids == e_ids and g_text == e_text
        assert g_logprobs == pytest.approx(e_logprobs, abs=1e-4)


def _load(url: str) -> LoadReport:
    return msgspec.json.decode(httpx.get(f"{url}/v1/load", headers=AUTH).content, type=LoadReport)


def test_disconnects_leave_the_pool_idle(tmp_path: Path, backends: list[Backend]) -> None:
    two = Backend(make_served_checkpoint("deepseek_v3", tmp_path / "ds"), tmp_path, "--tp", "2")
    backends.append(two)
    payload = {"tenant_salt": "a" * 32, "prompt": "a long story", "raw": True}
    sampling = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        for i in range(3):
            body = payload | {"request_id": f"gone-{i}", "sampling": sampling}
            with client.stream("POST", f"{two.url}/v1/generate", json=body, headers=AUTH) as response:
                lines = response.iter_lines()
                assert isinstance(_events.decode(next(lines)), TextDelta)  # then the client leaves
    deadline = time.monotonic() + 10
    while (load := _load(two.url)).free_pages != load.total_pages or load.running:
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    assert _text_and_logprobs(_generate(two.url, "after", "a long story"))[1]  # still serving


def test_a_killed_rank_fails_requests_retryably_and_the_group_restarts(tmp_path: Path) -> None:
    model = make_served_checkpoint("deepseek_v3", tmp_path / "ds")
    asyncio.run(_kill_and_restart(model, tmp_path))


async def _kill_and_restart(model: Path, tmp_path: Path) -> None:
    logs = tmp_path / "logs"
    logs.mkdir()
    b = BackendProcess("ds-tiny", model, "local-0", _free_port(), SECRET)
    parallel = ("--tp", "2")
    await start_backend(b, "float32", "cpu", logs, parallel)

    async def restart(child: object) -> None:
        await start_backend(b, "float32", "cpu", logs, parallel)

    supervisor = Supervisor([b], restart, first_backoff_s=0.1)
    supervisor.start()
    try:
        await asyncio.to_thread(_wait_healthy, b.url, None, logs / "local-0.log")
        assert b.process is not None
        first = b.process
        first_pid = first.pid
        (rank1,) = _children(first_pid)
        body = {
            "request_id": "in-flight",
            "tenant_salt": "a" * 32,
            "prompt": "a long story",
            "raw": True,
            "sampling": {"temperature": 0, "max_tokens": 400, "ignore_eos": True},
        }
        events: list[Event] = []
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", f"{b.url}/v1/generate", json=body, headers=AUTH) as response,
        ):
            async for line in response.aiter_lines():
                events.append(_events.decode(line))
                if len(events) == 2:
                    os.kill(rank1, signal.SIGKILL)
        last = events[-1]
        assert isinstance(events[0], TextDelta) and isinstance(last, Error), events[-3:]
        assert last.code == "busy" and last.status == 503  # the gateway's retryable Busy
        assert sum(isinstance(e, TextDelta) for e in events) < 400
        deadline = time.monotonic() + 60
        while b.process.pid == first_pid or supervisor.num_restarts == 0:
            assert time.monotonic() < deadline, "the backend was not restarted"
            await asyncio.sleep(0.1)
        assert first.returncode == RANKS_DOWN_EXIT  # it went down on its own, cleanly
        log = (logs / "local-0.log").read_text()
        # found by the failed collective or by the watcher of rank 0's children, whichever is first
        assert "the rank group failed" in log
        await asyncio.to_thread(_wait_healthy, b.url, None, logs / "local-0.log")
        assert len(_children(b.process.pid)) == 1  # a new rank 1
        text = await asyncio.to_thread(_generate, b.url, "again", "a long story")
        assert _text_and_logprobs(text)[1]
    finally:
        await supervisor.stop()
        if b.process is not None and b.process.returncode is None:
            b.process.terminate()
            await b.process.wait()


def test_a_hung_rank_is_found_by_the_timeout(tmp_path: Path, backends: list[Backend]) -> None:
    """A rank that stops answering (SIGSTOP: alive, silent) fails the next collective after
    `--rank-timeout-s`; the request in flight gets the retryable error and the backend exits."""
    two = Backend(
        make_served_checkpoint("deepseek_v3", tmp_path / "ds"), tmp_path, "--tp", "2", "--rank-timeout-s", "3"
    )
    backends.append(two)
    (rank1,) = _children(two.process.pid)
    os.kill(rank1, signal.SIGSTOP)
    start = time.monotonic()
    payload = {"request_id": "hung", "tenant_salt": "a" * 32, "prompt": "a long story", "raw": True}
    response = httpx.post(f"{two.url}/v1/generate", json=payload, headers=AUTH, timeout=60)
    if response.status_code == 200:  # accepted: its accounting event, then the error
        events = [_events.decode(line) for line in response.text.splitlines() if line]
        assert not any(isinstance(e, TextDelta) for e in events)
        last = events[-1]
    else:  # refused before its first event
        assert response.status_code == 503
        last = msgspec.json.decode(response.content, type=ErrorBody).error
    assert isinstance(last, Error) and last.code == "busy" and last.status == 503, response.text
    assert 2.5 < time.monotonic() - start < 30
    assert two.process.wait(timeout=30) == RANKS_DOWN_EXIT
    deadline = time.monotonic() + 10
    while Path(f"/proc/{rank1}").exists() and b"zombie" not in _state(rank1):
        assert time.monotonic() < deadline, "the hung rank outlived its group"
        time.sleep(0.1)


def _state(pid: int) -> bytes:
    try:
        return (
            b"zombie" if Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0] == b"Z" else b""
        )
    except OSError:
        return b"zombie"

"""`kumo backend --tp 2 --device cpu` through its HTTP API: the same greedy text and logprobs as
`--tp 1` for each architecture, the parallel layout in `/v1/model` (and its pool as `/v1/load`
counts it), every rank's pool idle after disconnects (`rank_probe` reads each rank's tags), a tag
fault on rank 1 that fails only its request, a hung rank, and a killed rank: the requests in flight
end with a retryable error, the backend exits, and the supervisor that `kumo serve` runs
(`gateway.serve.start_backend` + `Supervisor`) starts the whole rank group again, which serves again.
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
import torch
from PIL import Image

from backend.server.rank_group import RANKS_DOWN_EXIT
from gateway.serve import BackendProcess, start_backend
from gateway.supervisor import Supervisor
from schemas.backend import (
    Error,
    ErrorBody,
    Event,
    Finish,
    LoadReport,
    ModelCard,
    ReasoningDelta,
    Started,
    TextDelta,
    Usage,
)
from tests.backend.server import rank_probe
from tests.backend.server_checkpoints import SECRET, make_served_checkpoint
from tests.backend.server_process import _free_port
from tests.child import dies_with_pytest

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
    def __init__(self, model: Path, tmp: Path, *args: str, env: dict[str, str] | None = None) -> None:
        """`env`: on top of the test's environment (`rank_probe.environment()` for the probes)."""
        self.url = f"http://127.0.0.1:{(port := _free_port())}"
        self.log = tmp / f"backend-{port}.log"
        env = {
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(ROOT),
            "KUMO_BACKEND_SECRET": SECRET,
            **(env or {}),
        }
        with self.log.open("wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "gateway.cli", "backend", "--model", str(model), "--port", str(port),
                 "--dtype", "float32", "--max-pages", "64", "--page-size", "8", "--device", "cpu", *args],
                cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=dies_with_pytest(),
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
    """The answer (reasoning, then content, as one text), and the ids and logprobs of its content's
    tokens (`logprobs.content`)."""
    text, ids, logprobs = "", [], []
    for e in events:
        if isinstance(e, ReasoningDelta):
            text += e.text
        if isinstance(e, TextDelta):
            text += e.text
            for lp in e.logprobs or []:
                ids.append(lp.token_id)
                logprobs.append(lp.logprob)
    assert isinstance(events[-1], Finish), events
    return text, ids, logprobs


def _completion_tokens(events: list[Event]) -> int:
    return next(e.completion_tokens for e in events if isinstance(e, Usage))


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
        e_events, g_events = _generate(one.url, f"r{i}", prompt), _generate(two.url, f"r{i}", prompt)
        e_text, e_ids, e_logprobs = _text_and_logprobs(e_events)
        g_text, g_ids, g_logprobs = _text_and_logprobs(g_events)
        assert g_ids == e_ids and g_text == e_text
        assert _completion_tokens(e_events) == _completion_tokens(g_events) == 8
        assert g_logprobs == pytest.approx(e_logprobs, abs=1e-5)
    card = msgspec.json.decode(httpx.get(f"{two.url}/v1/model", headers=AUTH).content, type=ModelCard)
    named = dict(zip(args[::2], args[1::2], strict=True))
    assert (card.tp, card.ep, card.dcp) == (2, int(named.get("--ep", 2)), int(named.get("--dcp", 1)))
    # the pool as the gateway sees it: pages of page_size tokens of a sequence (8 on each DCP rank)
    load = _load(two.url)
    assert card.num_pages == load.total_pages == load.free_pages == 64 and card.page_size == 8 * card.dcp
    assert card.max_request_tokens == min(card.context_window, 64 * 8 * card.dcp)
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


def _stop_and_read_ranks(backend: Backend, dump: Path) -> list[dict[str, Any]]:
    """Stop the backend cleanly (SIGTERM: rank 0 sends the ranks stop) and read what each rank's
    pool held then (`rank_probe`)."""
    backend.process.terminate()
    # uvicorn re-raises the SIGTERM it served its shutdown on
    assert backend.process.wait(timeout=30) in (0, -signal.SIGTERM), backend.log.read_text()
    return rank_probe.read_dumps(dump, 2)


def _held_pages(rank0: dict[str, Any]) -> list[int]:
    return [p for p, n in enumerate(rank0["refcounts"]) if n]


def test_disconnects_leave_every_rank_idle(tmp_path: Path, backends: list[Backend]) -> None:
    """Rank 0's pool by `/v1/load`, and every rank's by what it holds when the group stops: no page
    held, and each rank's cache carries the tags rank 0's block manager gave (none stale, none
    missed), so the pool any rank reads is the one rank 0 hands out."""
    dump = tmp_path / "ranks"
    dump.mkdir()
    model = make_served_checkpoint("deepseek_v3", tmp_path / "ds")
    two = Backend(model, tmp_path, "--tp", "2", env=rank_probe.environment(dump=dump))
    backends.append(two)
    sampling = {"temperature": 0, "max_tokens": 300, "ignore_eos": True}
    with httpx.Client(timeout=60) as client:
        for i in range(3):
            body = {"request_id": f"gone-{i}", "tenant_salt": "a" * 32, "prompt": f"story {i}", "raw": True}
            body["sampling"] = sampling
            with client.stream("POST", f"{two.url}/v1/generate", json=body, headers=AUTH) as response:
                lines = response.iter_lines()
                assert isinstance(_events.decode(next(lines)), Started)
                for _ in range(20):  # a few pages' worth of tokens (8 a page), then the client leaves
                    assert isinstance(_events.decode(next(lines)), TextDelta)
    deadline = time.monotonic() + 10
    while (load := _load(two.url)).free_pages != load.total_pages or load.running:
        assert time.monotonic() < deadline, load
        time.sleep(0.1)
    assert _text_and_logprobs(_generate(two.url, "after", "a long story"))[1]  # still serving
    rank0, rank1 = _stop_and_read_ranks(two, dump)
    assert rank0["load"] == [64, 64] and not _held_pages(rank0)
    assert rank1["page_tags"] == rank0["page_tags"] == rank0["block_tags"]
    assert max(rank0["block_tags"]) >= 3 * 3  # each request had pages handed out; every rank followed
    assert rank1["num_steps"] == rank0["num_steps"]  # every step rank 0 ran, warm-up included


VICTIM = " ".join(str(i) for i in range(1, 40))  # raw: 100 tokens
LONG = 64  # only the victim's sequence gets this long: PROMPTS are 32 tokens at most, plus 16 generated


def test_a_tag_fault_on_rank_1_aborts_only_its_request(tmp_path: Path, backends: list[Backend]) -> None:
    """Rank 1 alone finds a stale page (`rank_probe`'s fault, in the victim's own last page): the
    victim's stream ends with the integrity error, raised on every rank before its token is sampled,
    while the requests in the same steps answer as when asked alone. Then both ranks' pools are idle
    and agree on every page's tag but the stale one, which nothing holds (its next owner gets a new
    tag), and the victim asked again is answered whole."""
    dump = tmp_path / "ranks"
    dump.mkdir()
    model = make_served_checkpoint("deepseek_v3", tmp_path / "ds")
    env = rank_probe.environment(dump=dump, fault_seq_len=LONG)
    two = Backend(model, tmp_path, "--tp", "2", env=env)
    backends.append(two)
    sampling = {"max_tokens": 16, "ignore_eos": True}
    with ThreadPoolExecutor(3) as pool:
        victim = pool.submit(_generate, two.url, "victim", VICTIM, **sampling)
        beside = [
            pool.submit(_generate, two.url, f"beside-{i}", p, **sampling) for i, p in enumerate(PROMPTS)
        ]
        victim_events, beside_events = victim.result(), [f.result() for f in beside]
    last = victim_events[-1]
    assert isinstance(last, Error) and (last.code, last.status) == ("integrity_abort", 500), victim_events
    assert "on another rank" in last.message
    got = [lp.token_id for e in victim_events if isinstance(e, TextDelta) for lp in e.logprobs or []]
    whole = _text_and_logprobs(_generate(two.url, "victim-again", VICTIM, **sampling))
    assert len(whole[1]) == 16 and got == whole[1][: len(got)] and len(got) < 16
    for i, (prompt, events) in enumerate(zip(PROMPTS, beside_events, strict=True)):
        alone = _text_and_logprobs(_generate(two.url, f"alone-{i}", prompt, **sampling))
        text, ids, logprobs = _text_and_logprobs(events)
        assert (text, ids) == alone[:2] and len(ids) == 16
        assert logprobs == pytest.approx(alone[2], abs=1e-5)
    load = _load(two.url)
    assert load.free_pages == load.total_pages and load.running == load.waiting == 0
    rank0, rank1 = _stop_and_read_ranks(two, dump)
    assert rank0["page_tags"] == rank0["block_tags"] and not _held_pages(rank0)
    (stale,) = [
        p for p, (t0, t1) in enumerate(zip(rank0["page_tags"], rank1["page_tags"], strict=True)) if t0 != t1
    ]
    assert rank1["page_tags"][stale] == rank0["page_tags"][stale] + rank_probe.STALE
    assert rank1["num_steps"] == rank0["num_steps"]


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
        assert isinstance(events[0], Started) and isinstance(events[1], TextDelta), events[:3]
        assert isinstance(last, Error), events[-3:]
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


def test_an_idle_group_and_a_slow_rank_0_outlast_the_rank_timeout(
    tmp_path: Path, backends: list[Backend]
) -> None:
    """The other ranks wait for rank 0 in collectives that fail after `--rank-timeout-s` (2 s here):
    rank 0 building its engine 5 s after them (the tokenizer and vision tower are its alone) meets
    them in the group's store first, and an idle rank 0 sends keep-alives, so the group neither
    fails to start nor goes down (and restarts) when no request comes for a while (2026-12-06: it
    did, once a timeout, 120 s by default)."""
    two = Backend(
        make_served_checkpoint("deepseek_v3", tmp_path / "ds"), tmp_path, "--tp", "2", "--rank-timeout-s", "2",
        env=rank_probe.environment(build_delay_s=5),
    )  # fmt: skip
    backends.append(two)
    (rank1,) = _children(two.process.pid)
    time.sleep(7)  # idle, past three timeouts
    assert two.process.poll() is None and _children(two.process.pid) == [rank1], two.log.read_text()
    events = _generate(two.url, "after-idle", "a long story")
    assert isinstance(events[-1], Finish) and events[-1].reason == "length"
    assert "rank group failed" not in two.log.read_text()


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

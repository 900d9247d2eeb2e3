"""`kumo serve --tp 2 --device cpu` through the public API answers what `kumo serve --tp 1` answers,
for every architecture: the default Kimi K2.6 (DeepSeek-V3 text model + MoonViT, with an image) and
GLM 5.2 (GLM-5 with DSA), both as served (INT4 routed experts, FP8 KV cache), and two `--model
NAME=PATH` checkpoints, DeepSeek-V3 and GLM-4.5 (GQA), in float32.

Each `kumo serve` runs once for the module (the --tp 1 one first, then the --tp 2 one over a copy of
its converted checkpoints, so both serve the same bytes); every request is asked of each, greedy with
logprobs, on the Workers AI route (`/ai/run/@cf/...`) and the OpenAI-compatible one
(`/ai/v1/chat/completions`, streamed). The catalog both gateways render must agree too.

The --tp 2 one then runs two failures (its ranks carry `tests.backend.server.rank_probe`'s fault):
a stale page on rank 1 of the DeepSeek backend, which must fail only the request that read it, with
the Workers AI error envelope; and rank 1 killed mid-stream, which must end that stream with the
retryable error, and be served again once `kumo serve` has restarted the group.
"""

from __future__ import annotations

import base64
import io
import json
import os
import re
import shutil
import signal
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from PIL import Image

from benchmarks.client import spawn_serve
from tests.backend.server import rank_probe
from tests.backend.server_checkpoints import make_served_checkpoint
from tests.e2e.serve_process import GLM, KIMI, ROOT, Kumo, _children, served_url

pytestmark = pytest.mark.slow

DEEPSEEK = "@cf/kumo/deepseek-v3-tiny"
GLM45 = "@cf/kumo/glm-4.5-tiny"
MODELS = [KIMI, GLM, DEEPSEEK, GLM45]
PROMPTS = ["Hello", "What is 2 + 3?"]
MAX_TOKENS = 8


def _png(seed: int) -> str:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (56, 70, 3), dtype=np.uint8)).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _messages(model: str) -> list[list[dict[str, Any]]]:
    """The conversations asked of `model`: the prompts, and for Kimi one with an image."""
    asked: list[list[dict[str, Any]]] = [[{"role": "user", "content": p}] for p in PROMPTS]
    if model == KIMI:
        image = {"type": "image_url", "image_url": {"url": _png(1)}}
        asked.append([{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    return asked


@dataclass(frozen=True)
class Answer:
    text: str
    tokens: list[str]
    logprobs: list[float]
    top: list[list[tuple[str, float]]]  # each token's two most likely tokens


def _answer(logprobs: list[dict[str, Any]], text: str) -> Answer:
    return Answer(
        text,
        [lp["token"] for lp in logprobs],
        [lp["logprob"] for lp in logprobs],
        [[(t["token"], t["logprob"]) for t in lp["top_logprobs"]] for lp in logprobs],
    )


def _body(messages: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "logprobs": True,
        "top_logprobs": 2,
        "chat_template_kwargs": {"enable_thinking": False},
    }


def _run(kumo: Kumo, http: httpx.Client, model: str, messages: list[dict[str, Any]]) -> Answer:
    """Workers AI: `POST /ai/run/{model}`, the whole answer in the `result` envelope."""
    r = http.post(kumo.path(f"/ai/run/{model}"), json=_body(messages), headers=kumo.auth)
    assert r.status_code == 200, r.text
    choice = r.json()["result"]["choices"][0]
    message = choice["message"]
    return _answer(choice["logprobs"]["content"], (message["reasoning_content"] or "") + message["content"])


def _streamed(kumo: Kumo, http: httpx.Client, model: str, messages: list[dict[str, Any]]) -> Answer:
    """OpenAI-compatible: `POST /ai/v1/chat/completions` with `stream`, the chunks joined."""
    body = _body(messages) | {"model": model, "stream": True}
    r = http.post(kumo.path("/ai/v1/chat/completions"), json=body, headers=kumo.auth)
    assert r.status_code == 200, r.text
    text, logprobs = "", []
    for line in r.text.splitlines():
        if not line.startswith("data: {"):
            continue
        for choice in json.loads(line.removeprefix("data: "))["choices"]:
            delta = choice["delta"]
            text += (delta.get("reasoning_content") or "") + (delta.get("content") or "")
            logprobs += (choice.get("logprobs") or {}).get("content") or []
    return _answer(logprobs, text)


# the fault on rank 1 (`rank_probe`): one stale page in the first pure-decode step with a sequence of
# LONG tokens or more; only the victim's gets that long (the other chats stay under ~80 tokens, the
# victim's is over 200)
LONG = 160
VICTIM = [{"role": "user", "content": " ".join(str(i) for i in range(1, 150))}]


@dataclass(frozen=True)
class Fault:
    victim: httpx.Response  # the victim's answer, on /ai/run
    beside: list[Answer]  # PROMPTS, asked at the same time
    again: Answer  # the victim, asked again after


@dataclass(frozen=True)
class Killed:
    stream: str  # the SSE text of the request in flight when its backend's rank 1 was killed
    num_refused: int  # answers (retryable) before the restarted group answered
    again: Answer  # PROMPTS[0], asked once the group was back
    killed: int  # the rank 1 killed
    ranks: list[int]  # the restarted backend's rank processes


def _rank_processes(pid: int) -> list[int]:
    return [
        c for c in _children(pid) if b"backend.server.rank_group" in Path(f"/proc/{c}/cmdline").read_bytes()
    ]


def _backend_of(serve_pid: int, model: str) -> int:
    (pid,) = [b for b in _children(serve_pid) if model.encode() in Path(f"/proc/{b}/cmdline").read_bytes()]
    return pid


def _kill_rank_1(kumo: Kumo, http: httpx.Client, serve_pid: int) -> Killed:
    """Kill the DeepSeek backend's rank 1 while a streamed answer is under way; then ask until the
    group `kumo serve` restarts answers again."""
    backend = _backend_of(serve_pid, DEEPSEEK)
    (rank1,) = _rank_processes(backend)
    body = _body(_messages(DEEPSEEK)[0]) | {"model": DEEPSEEK, "stream": True, "max_tokens": 400}
    lines = []
    with http.stream("POST", kumo.path("/ai/v1/chat/completions"), json=body, headers=kumo.auth) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            lines.append(line)
            if sum(x.startswith("data: {") for x in lines) == 3:  # the role chunk, then tokens
                os.kill(rank1, signal.SIGKILL)
    deadline, num_refused = time.monotonic() + 120, 0
    while (
        r := http.post(
            kumo.path(f"/ai/run/{DEEPSEEK}"), json=_body(_messages(DEEPSEEK)[0]), headers=kumo.auth
        )
    ).status_code != 200:
        assert r.status_code in (429, 503) and r.json()["success"] is False, r.text  # retryable, not a hang
        assert time.monotonic() < deadline, "the rank group was not restarted"
        num_refused += 1
        time.sleep(0.5)
    choice = r.json()["result"]["choices"][0]
    again = _answer(
        choice["logprobs"]["content"],
        (choice["message"]["reasoning_content"] or "") + choice["message"]["content"],
    )
    return Killed(
        "\n".join(lines), num_refused, again, rank1, _rank_processes(_backend_of(serve_pid, DEEPSEEK))
    )


@dataclass
class Served:
    """What one `kumo serve` answered: per model, the answers in the order asked; the catalog; the
    victim's answer (--tp 1) or what the fault on rank 1 did (--tp 2)."""

    answers: dict[str, list[Answer]] = field(default_factory=dict)
    catalog: list[dict[str, Any]] = field(default_factory=list)
    ranks_per_backend: list[int] = field(default_factory=list)  # rank processes each backend started
    rank_timeouts: list[str] = field(default_factory=list)  # each backend's --rank-timeout-s
    victim: Answer | None = None
    fault: Fault | None = None
    killed: Killed | None = None


def _flag(pid: int, name: str) -> str:
    """The value of `name` on process `pid`'s command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index(name) + 1]


def _fault(kumo: Kumo, http: httpx.Client) -> Fault:
    with ThreadPoolExecutor(3) as pool:
        victim = pool.submit(
            http.post, kumo.path(f"/ai/run/{DEEPSEEK}"), json=_body(VICTIM), headers=kumo.auth
        )
        beside = [pool.submit(_run, kumo, http, DEEPSEEK, m) for m in _messages(DEEPSEEK)]
        aborted, answered = victim.result(), [f.result() for f in beside]
    return Fault(aborted, answered, _run(kumo, http, DEEPSEEK, VICTIM))


def _serve(data_dir: Path, checkpoints: dict[str, Path], tp: int) -> Served:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if tp == 2:  # rank 1 of every backend gets the stale page; only the DeepSeek one is asked for it
        env |= rank_probe.environment(fault_seq_len=LONG)
    env.pop("KUMO_ADMIN_TOKEN", None)
    models = [a for name, path in checkpoints.items() for a in ("--model", f"{name}={path}")]
    args = [
        "--port",
        "0",
        "--data-dir",
        str(data_dir),
        "--device",
        "cpu",
        "--tp",
        str(tp),
        "--rank-timeout-s",
        "90",
        *models,
    ]
    data_dir.mkdir(parents=True, exist_ok=True)
    with (data_dir / "serve.log").open("wb") as log:
        try:
            process, printed = spawn_serve(args, cwd=ROOT, env=env, stderr=log, timeout_s=300)
        except RuntimeError as exc:  # with every backend's log: a rank's failure is printed only there
            logs = "".join(
                f"\n--- {p.name}\n{p.read_text()[-6000:]}" for p in sorted(data_dir.glob("logs/*.log"))
            )
            raise RuntimeError(f"{exc}{(data_dir / 'serve.log').read_text()}{logs}") from None
    try:
        account = re.search(r"Account ID: ([0-9a-f]{32})", printed)
        token = re.search(r"API token:  (\S+)", printed)
        assert account and token, printed
        kumo = Kumo(served_url(printed), account.group(1), token.group(1), data_dir)
        served = Served()
        backends = _children(process.pid)
        served.rank_timeouts = [_flag(b, "--rank-timeout-s") for b in backends]
        served.ranks_per_backend = [
            sum(b"backend.server.rank_group" in Path(f"/proc/{c}/cmdline").read_bytes() for c in _children(b))
            for b in backends
        ]
        with httpx.Client(timeout=120) as http:
            for model in MODELS:
                asked = _messages(model)
                served.answers[model] = [_run(kumo, http, model, m) for m in asked]
                served.answers[model].append(_streamed(kumo, http, model, asked[0]))
            r = http.get(kumo.path("/ai/models/search"), headers=kumo.auth)
            assert r.status_code == 200, r.text
            served.catalog = r.json()["result"]
            if tp == 1:
                served.victim = _run(kumo, http, DEEPSEEK, VICTIM)
            else:  # after the answers above: the fault cannot touch them
                served.fault = _fault(kumo, http)
                served.killed = _kill_rank_1(kumo, http, process.pid)
        return served
    finally:
        process.terminate()
        try:
            assert process.wait(timeout=60) == 0, "kumo serve did not stop cleanly"
        finally:
            if process.returncode is None:
                process.kill()
                process.wait()
            if process.stdout is not None:
                process.stdout.close()


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[int, Served]]:
    tmp = tmp_path_factory.mktemp("serve-ranks")
    checkpoints = {
        DEEPSEEK: make_served_checkpoint("deepseek_v3", tmp / "deepseek-v3"),
        GLM45: make_served_checkpoint("glm4_moe", tmp / "glm-4.5"),
    }
    one = _serve(tmp / "tp1", checkpoints, 1)
    # the same converted checkpoints (INT4 experts, calibrated FP8 KV scales) for both
    shutil.copytree(tmp / "tp1" / "checkpoints", tmp / "tp2" / "checkpoints")
    two = _serve(tmp / "tp2", checkpoints, 2)
    yield {1: one, 2: two}


def test_every_backend_of_serve_tp_2_is_a_group_of_two_ranks(served: dict[int, Served]) -> None:
    assert served[1].ranks_per_backend == [0] * len(MODELS)
    assert served[2].ranks_per_backend == [1] * len(MODELS)  # rank 0 is the backend process itself
    assert served[2].rank_timeouts == ["90.0"] * len(MODELS)  # kumo serve passes its own on


@pytest.mark.parametrize("model", MODELS)
def test_two_ranks_answer_what_one_answers(model: str, served: dict[int, Served]) -> None:
    one, two = served[1].answers[model], served[2].answers[model]
    assert len(one) == len(two) == len(_messages(model)) + 1
    for expected, got in zip(one, two, strict=True):
        assert expected.tokens and expected.text
        assert got.tokens == expected.tokens and got.text == expected.text
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in got.top] == [[t for t, _ in top] for top in expected.top]
        assert [lp for top in got.top for _, lp in top] == pytest.approx(
            [lp for top in expected.top for _, lp in top], abs=1e-4
        )


@pytest.mark.parametrize("tp", [1, 2])
def test_streamed_answers_carry_every_tokens_logprob(tp: int, served: dict[int, Served]) -> None:
    """The streamed OpenAI answer is the Workers AI one, logprob for logprob: a token whose text is
    held back (part of a character) or is leading whitespace still gets its chunk."""
    for model in MODELS:
        answers = served[tp].answers[model]
        streamed, whole = answers[-1], answers[0]
        assert streamed.tokens == whole.tokens and streamed.text == whole.text, model
        assert streamed.logprobs == pytest.approx(whole.logprobs, abs=1e-4), model


def test_the_catalog_is_the_same_under_tp_2(served: dict[int, Served]) -> None:
    assert {m["name"] for m in served[2].catalog} == set(MODELS)
    # context window, weights, KV dtype, capabilities: all but when `--model`'s entries were made
    for s in served.values():
        for m in s.catalog:
            if m["name"] in (DEEPSEEK, GLM45):
                del m["created_at"]
    assert served[2].catalog == served[1].catalog


def test_a_tag_fault_on_rank_1_fails_only_its_request(served: dict[int, Served]) -> None:
    """Rank 1's stale page aborts the one request that read it, on every rank, with the Workers AI
    error envelope; the requests beside it answer what --tp 1 answers, and so does the victim when
    asked again (its pages were not handed out again from the prefix cache)."""
    fault, victim = served[2].fault, served[1].victim
    assert fault is not None and victim is not None
    assert fault.victim.status_code == 500, fault.victim.text
    assert fault.victim.json() == {
        "result": None,
        "success": False,
        "errors": [{"code": 3000, "message": "AiError: Unknown internal error"}],  # no backend internals
        "messages": [],
    }
    for expected, got in zip(served[1].answers[DEEPSEEK][: len(PROMPTS)], fault.beside, strict=True):
        assert got.tokens == expected.tokens and got.text == expected.text
        assert got.logprobs == pytest.approx(expected.logprobs, abs=1e-4)
    assert fault.again.tokens == victim.tokens and fault.again.text == victim.text
    assert fault.again.logprobs == pytest.approx(victim.logprobs, abs=1e-4)


def test_a_killed_rank_ends_its_stream_retryably_and_serve_restarts_the_group(
    served: dict[int, Served],
) -> None:
    """The answer in flight ends with the retryable error in OpenAI's in-stream format (no `[DONE]`),
    requests meanwhile are refused retryably (never left hanging), and once `kumo serve`'s supervisor
    has restarted the whole group (a new rank 1) it answers what --tp 1 answers."""
    killed = served[2].killed
    assert killed is not None
    frames = [
        json.loads(x.removeprefix("data: ")) for x in killed.stream.splitlines() if x.startswith("data: {")
    ]
    assert frames[-1] == {
        "error": {
            "message": "AiError: Capacity temporarily exceeded, please try again.",
            "type": "server_error",
            "code": 3040,
        }
    }
    assert "[DONE]" not in killed.stream and len(frames) < 400
    assert len(killed.ranks) == 1 and killed.ranks != [killed.killed]  # a new rank 1
    expected = served[1].answers[DEEPSEEK][0]
    assert killed.again.tokens == expected.tokens and killed.again.text == expected.text
    assert killed.again.logprobs == pytest.approx(expected.logprobs, abs=1e-4)

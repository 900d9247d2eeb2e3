"""`wrangler-mock ai models|run` and `wrangler-mock dev`, against the fake gateway on a real port."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from fake_workers_ai import ACCOUNT, LEGACY_MODEL, OPENAI_MODEL, TOKEN, FakeGateway
from wm_support import EXAMPLES
from wrangler_mock.cli import main

from tests.child import dies_with_pytest

WRANGLER_MOCK = Path(sys.executable).with_name("wrangler-mock")


@pytest.fixture
def gateway_env(
    fake_server: tuple[str, FakeGateway], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> FakeGateway:
    base, gateway = fake_server
    monkeypatch.setenv("CLOUDFLARE_API_BASE_URL", base)
    monkeypatch.setenv("CLOUDFLARE_API_TOKEN", TOKEN)
    monkeypatch.setenv("CLOUDFLARE_ACCOUNT_ID", ACCOUNT)
    monkeypatch.chdir(tmp_path)  # no stray wrangler.toml
    return gateway


def test_models_json_pages_the_whole_catalog(
    gateway_env: FakeGateway, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["ai", "models", "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert len(gateway_env.catalog) == 102  # 50 + 50 + 2: three pages
    assert printed == gateway_env.catalog


def test_models_table(gateway_env: FakeGateway, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ai", "models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("┌") and lines[-1].startswith("└")
    assert [c.strip() for c in lines[1].strip("│").split("│")] == ["model", "name", "description", "task"]
    kimi = gateway_env.catalog[0]
    row = [c.strip() for c in lines[3].strip("│").split("│")]
    assert row[:2] == [kimi["id"], kimi["name"]] and row[3] == "Text Generation"
    assert row[2] == kimi["description"][:100] + "..."  # not a terminal: wrangler cuts at 100
    assert len({len(line) for line in lines}) == 1  # every line as wide as the box


def test_run_prints_the_answer(gateway_env: FakeGateway, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ai", "run", LEGACY_MODEL, "--prompt", "hello world"]) == 0
    assert capsys.readouterr().out == "echo: hello world\n"
    assert main(["ai", "run", OPENAI_MODEL, "--prompt", "hi", "--session", "ses_9", "--max-tokens", "5"]) == 0
    assert capsys.readouterr().out == "echo: hi\n"
    sent = gateway_env.requests[-1]
    assert sent["headers"]["x-session-affinity"] == "ses_9" and sent["body"] == {
        "prompt": "hi",
        "max_tokens": 5,
    }


def test_run_streams(gateway_env: FakeGateway, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ai", "run", OPENAI_MODEL, "--prompt", "a b c", "--stream"]) == 0
    assert capsys.readouterr().out == "echo: a b c\n"
    assert main(["ai", "run", LEGACY_MODEL, "--prompt", "a b", "--stream", "--json"]) == 0
    frames = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert frames[-1]["usage"]["total_tokens"] == 10 and "".join(f["response"] for f in frames) == "echo: a b"


def test_run_json_prints_the_result(gateway_env: FakeGateway, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ai", "run", OPENAI_MODEL, "--prompt", "q", "--system", "be brief", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["object"] == "chat.completion" and result["choices"][0]["message"]["content"] == "echo: q"
    assert gateway_env.requests[-1]["body"]["messages"][0] == {"role": "system", "content": "be brief"}


def test_errors_carry_code_and_message(
    gateway_env: FakeGateway, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["ai", "run", "@cf/foo/bar", "--prompt", "hi"]) == 1
    assert "AiError: AiError: No such model @cf/foo/bar or task [code: 5007]" in capsys.readouterr().err
    monkeypatch.setenv("CLOUDFLARE_API_TOKEN", "not-the-token")
    assert main(["ai", "models"]) == 1
    assert "Authentication error [code: 10000]" in capsys.readouterr().err


def test_account_from_memberships_or_toml(
    gateway_env: FakeGateway,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    monkeypatch.delenv("CLOUDFLARE_ACCOUNT_ID")
    assert main(["ai", "run", LEGACY_MODEL, "--prompt", "m"]) == 0
    assert capsys.readouterr().out == "echo: m\n"
    (tmp_path / "wrangler.toml").write_text('name = "w"\nmain = "w.py"\naccount_id = "feedface"\n')
    assert main(["ai", "models"]) == 1
    assert "[code: 7003]" in capsys.readouterr().err  # the toml's (wrong) account was used


@pytest.fixture
def dev_process(
    fake_server: tuple[str, FakeGateway], tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`wrangler-mock dev` on the chat example, on a free port, as a user would start it."""
    base, _ = fake_server
    env = {
        **os.environ,
        "CLOUDFLARE_API_BASE_URL": base,
        "CLOUDFLARE_API_TOKEN": TOKEN,
        "CLOUDFLARE_ACCOUNT_ID": ACCOUNT,
    }
    config = EXAMPLES / "chat" / "wrangler.toml"
    command = [
        str(WRANGLER_MOCK),
        "dev",
        "-c",
        str(config),
        "--port",
        "0",
        "--var",
        "SYSTEM_PROMPT:Be terse.",
    ]
    log = (tmp_path / "dev.log").open("w")
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=log, text=True, preexec_fn=dies_with_pytest()
    )
    try:
        url = None
        assert process.stdout is not None
        for line in process.stdout:
            if line.startswith("Ready on "):
                url = line.removeprefix("Ready on ").strip()
                break
        assert url, f"wrangler-mock dev exited before it was ready: {(tmp_path / 'dev.log').read_text()}"
        yield url, process
    finally:
        process.terminate()
        process.wait(timeout=10)
        assert process.stdout is not None
        process.stdout.close()
        log.close()


def test_dev_serves_the_worker(
    dev_process: tuple[str, subprocess.Popen[str]], fake_server: tuple[str, FakeGateway]
) -> None:
    url, _ = dev_process
    response = httpx.post(url, json={"prompt": "ping"}, timeout=30)
    assert response.status_code == 200 and response.json()["reply"] == "echo: ping"
    assert fake_server[1].requests[-1]["body"]["messages"][0]["content"] == "Be terse."
    with httpx.stream("POST", url, json={"prompt": "p q", "stream": True}, timeout=30) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        body = streamed.read().decode()
    assert body.rstrip().endswith("data: [DONE]")


def test_dev_client_disconnect_closes_the_upstream_stream(
    dev_process: tuple[str, subprocess.Popen[str]], fake_server: tuple[str, FakeGateway]
) -> None:
    url, _ = dev_process
    gateway = fake_server[1]
    # relative to what was open before: the gateway is shared by the session's tests (the absolute
    # `== 1` here read 0 once on a loaded CI machine, 2026-12-02)
    num_frames_before, open_before = gateway.num_frames_sent, gateway.num_open_streams
    with httpx.stream("POST", url, json={"prompt": "slow please", "stream": True}, timeout=30) as streamed:
        first = next(streamed.iter_bytes())
        assert first.startswith(b"data: ")
        assert (
            gateway.num_open_streams == open_before + 1
        )  # the upstream stream is open while the client reads
    deadline = time.monotonic() + 5
    while gateway.num_open_streams > open_before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert gateway.num_open_streams == open_before, "the gateway kept streaming to a Worker whose client left"
    assert gateway.num_frames_sent - num_frames_before < 100  # of 400: it stopped early


def test_dev_without_a_config_says_so(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["dev", "-c", str(tmp_path / "wrangler.toml")]) == 1
    assert "✘ [ERROR] no wrangler config at" in capsys.readouterr().err
    (tmp_path / "wrangler.toml").write_text('name = "w"\nmain = "missing.py"\n')
    assert main(["dev", "-c", str(tmp_path / "wrangler.toml")]) == 1
    assert "missing.py does not exist" in capsys.readouterr().err


async def test_outbound_fetch_from_a_worker(fake_server: tuple[str, FakeGateway]) -> None:
    from wrangler_mock.shims.workers import fetch

    base, _ = fake_server
    response = await fetch(f"{base}/memberships", headers={"Authorization": f"Bearer {TOKEN}"})
    assert response.status == 200 and (await response.json()).result[0].account.id == ACCOUNT
    denied = await fetch(f"{base}/memberships", method="GET")
    assert denied.status == 401 and not denied.ok


def test_dev_on_a_taken_port_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = EXAMPLES / "chat" / "wrangler.toml"
        assert main(["dev", "-c", str(config), "--port", str(port)]) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in capsys.readouterr().err

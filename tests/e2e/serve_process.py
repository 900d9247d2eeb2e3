"""One `kumo serve` for the whole e2e session: real `kumo backend` processes on the CPU.

The data dir starts empty, so `kumo serve` takes its first-start path: it converts the trained
nano models in models/ to INT4 experts + FP8 KV itself; a random GLM-4.5 checkpoint is added with
`--legacy-model` so the legacy family runs through a real backend too. The account id and token
are read from what `kumo serve` prints.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from benchmarks.client import spawn_serve

if TYPE_CHECKING:  # the SDK is imported where a client is made: the GPU image has no openai
    import openai

ROOT = Path(__file__).resolve().parents[2]
LEGACY = "@cf/kumo/glm-4.5"
KIMI = "@cf/moonshotai/kimi-k2.6"
GLM = "@cf/zai-org/glm-5.2"


@dataclass(frozen=True)
class Kumo:
    url: str
    account: str
    token: str
    data_dir: Path
    admin_token: str | None = None  # the generated admin token `kumo serve` printed
    printed: str = ""  # what `kumo serve` printed up to its ready banner, the banner included

    def path(self, rest: str) -> str:
        return f"{self.url}/client/v4/accounts/{self.account}{rest}"

    @property
    def auth(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.token}"}


def _children(pid: int) -> list[int]:
    """Process ids whose parent is `pid` (Linux /proc)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            out.append(int(stat.parent.name))
    return out


def served_url(printed: str) -> str:
    """The URL `kumo serve` announced (started with `--port 0`: the port it bound and holds, where a
    port picked here and passed in could be taken by another process before it binds)."""
    url = re.search(r"Kumo is ready at (http://\S+)", printed)
    assert url, printed
    return url.group(1)


@pytest.fixture(scope="session")
def kumo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Kumo]:
    data_dir = tmp_path_factory.mktemp("kumo-serve")
    legacy = data_dir / "glm-4.5"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    subprocess.run(
        [sys.executable, "-m", "backend.tools.random_checkpoint", "glm-4.5", str(legacy)],
        env=env,
        check=True,
        capture_output=True,
    )
    env.pop("KUMO_ADMIN_TOKEN", None)
    log = (data_dir / "serve.log").open("wb")
    try:
        process, text = spawn_serve(
            ["--port", "0", "--data-dir", str(data_dir), "--legacy-model", f"{LEGACY}={legacy}"],
            cwd=ROOT, env=env, stderr=log, timeout_s=300,
        )  # fmt: skip
    except RuntimeError as exc:
        raise RuntimeError(f"{exc}{(data_dir / 'serve.log').read_text()}") from None
    account = re.search(r"Account ID: ([0-9a-f]{32})", text)
    token = re.search(r"API token:  (\S+)", text)
    assert account and token, text
    admin = re.search(r"Admin token: (kumo_admin_\S+)", text)
    yield Kumo(
        served_url(text),
        account.group(1),
        token.group(1),
        data_dir,
        admin.group(1) if admin else None,
        text,
    )
    children = _children(process.pid)
    assert len(children) == 3  # one backend per model
    process.terminate()
    try:
        code = process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise
    assert code == 0, "kumo serve did not stop cleanly on SIGTERM"
    assert not [pid for pid in children if Path(f"/proc/{pid}").exists()], "backends outlived kumo serve"
    if process.stdout is not None:
        process.stdout.close()
    log.close()


_sdk_clients: list[openai.OpenAI] = []


def sdk_client(kumo: Kumo, timeout: float = 180) -> openai.OpenAI:
    """The `openai` SDK's client on the OpenAI-compatible routes, closed after the test by
    `close_sdk_clients` (an unclosed one leaves its pooled sockets to the garbage collector: a
    ResourceWarning, an error, in whichever later test it happens to run)."""
    import openai

    made = openai.OpenAI(api_key=kumo.token, base_url=kumo.path("/ai/v1"), max_retries=0, timeout=timeout)
    _sdk_clients.append(made)
    return made


@pytest.fixture(autouse=True)
def close_sdk_clients() -> Iterator[None]:
    yield
    while _sdk_clients:
        _sdk_clients.pop().close()

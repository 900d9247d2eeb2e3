# ruff: noqa: F811  (pytest fixtures imported by name)
"""`kumo gateway --catalog --pools`: a standalone gateway process in front of backends named in a
pools file, administered through the admin API it mounts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from gateway_harness import GLM, Harness, harness, standalone_gateway  # noqa: F401  (fixture)

ROOT = Path(__file__).resolve().parents[2]
ADMIN = "kumo_admin_for_the_command_test_0123456789"


def gateway_command(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-m", "gateway.cli", "gateway", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )


def test_bad_files_are_reported_not_raised(tmp_path: Path) -> None:
    pools = tmp_path / "pools.toml"
    pools.write_text("[pools.x\n")
    done = gateway_command("--pools", str(pools), "--data-dir", str(tmp_path))
    assert done.returncode == 2 and "pools file" in done.stderr and "Traceback" not in done.stderr
    pools.write_text('[pools.other]\nreplicas = ["http://127.0.0.1:1"]\nsecret = "s"\n')
    done = gateway_command("--pools", str(pools), "--data-dir", str(tmp_path))
    assert done.returncode == 2 and "no pool named glm-5.2, kimi-k2.6" in done.stderr


async def test_a_standalone_gateway_serves_the_pools_file(harness: Harness, tmp_path: Path) -> None:
    async with standalone_gateway(harness, tmp_path, admin_token=ADMIN) as g:
        r = await g.http.post(
            f"{g.url}/client/v4/accounts/{g.account}/ai/run/{GLM}",
            headers={"authorization": f"Bearer {g.token}"},
            json={"prompt": "standalone"},
        )
        assert r.status_code == 200, r.text
        assert r.json()["result"]["choices"][0]["message"]["content"] == "echo: standalone"
        g.proc.terminate()
        await g.proc.wait()


def test_ctrl_c_ends_a_command_by_sigint_without_a_traceback() -> None:
    # as an untraced interrupt would: a shell script running the command stops too (an exit code
    # of 130 would tell it the command handled the signal)
    code = (
        "import gateway.server as s\n"
        "def interrupted(argv):\n    raise KeyboardInterrupt\n"
        "s.main = interrupted\n"
        "from gateway.cli import main\n"
        "main(['gateway', '--pools', 'x'])\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
    )  # fmt: skip
    assert done.returncode == -signal.SIGINT, done
    assert "Traceback" not in done.stderr, done.stderr

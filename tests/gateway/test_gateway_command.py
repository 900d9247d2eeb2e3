# ruff: noqa: F811  (pytest fixtures imported by name)
"""`kumo gateway --catalog --pools`: a standalone gateway process in front of backends named in a
pools file, administered through the admin API it mounts."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
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


def test_ctrl_c_is_an_exit_code_not_a_traceback(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from gateway import cli, server

    def interrupted(argv: list[str]) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(server, "main", interrupted)
    assert cli.main(["gateway", "--pools", "x"]) == 130  # what a shell reports for SIGINT
    assert "Traceback" not in capsys.readouterr().err

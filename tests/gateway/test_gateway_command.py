# ruff: noqa: F811  (pytest fixtures imported by name)
"""`kumo gateway --catalog --pools`: a standalone gateway process in front of backends named in a
pools file, administered through the admin API it mounts."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from pathlib import Path

import httpx
from gateway_harness import GLM, Harness, harness  # noqa: F401  (fixture)

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
    router = harness.services.router
    lines = []
    for name in ("kimi-k2.6", "glm-5.2"):
        urls = ", ".join(f'"{r.url}"' for r in router.pools[name].replicas)
        lines.append(f'[pools."{name}"]\nreplicas = [{urls}]\nsecret = "fake-secret"\n')
    pools = "".join(lines)
    (tmp_path / "pools.toml").write_text(pools)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, KUMO_ADMIN_TOKEN=ADMIN, PYTHONPATH=str(ROOT))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "gateway.cli", "gateway", "--pools", str(tmp_path / "pools.toml"),
        "--port", str(port), "--data-dir", str(tmp_path / "data"),
        env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        async with httpx.AsyncClient(timeout=10) as http:
            for _ in range(200):
                try:
                    if (await http.get(f"{url}/healthz")).status_code == 200:
                        break
                except httpx.TransportError:
                    await asyncio.sleep(0.1)
            admin = {"authorization": f"Bearer {ADMIN}"}
            tenant = (
                await http.post(
                    f"{url}/admin/v1/tenants", headers=admin, json={"name": "acme", "plan": "paid"}
                )
            ).json()["result"]
            token = (
                await http.post(
                    f"{url}/admin/v1/tenants/{tenant['id']}/tokens", headers=admin, json={"name": "t"}
                )
            ).json()["result"]
            r = await http.post(
                f"{url}/client/v4/accounts/{tenant['id']}/ai/run/{GLM}",
                headers={"authorization": f"Bearer {token['value']}"},
                json={"prompt": "standalone"},
            )
            assert r.status_code == 200, r.text
            assert r.json()["result"]["choices"][0]["message"]["content"] == "echo: standalone"
    finally:
        proc.terminate()
        await proc.wait()

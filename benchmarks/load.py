"""`kumo bench load`: the embedded default (`kumo serve`, CPU backends) under load, then the
gateway's own latency measured against its backends.

1. Load: N client loops stream chat completions through `/ai/run` for M minutes; a share of them
   vanish mid-stream (read a few frames, drop the connection). Every answer is classified: done,
   vanished (intended), or an error (HTTP status, in-band error frame, transport error). Reported:
   the counts, the gateway's and each backend's RSS before and after, and each backend's
   `/v1/load` once the clients stop, which must come back to idle (nothing running or waiting,
   every page free or evictable).
2. Overhead: the same request (1 output token, greedy) sent straight to a backend over the
   internal protocol and through the gateway, interleaved pair by pair, one at a time; the added
   latency is the per-pair difference (p50/p99), and the p50/p99 of each path.

The backends' ports and secrets are read from their /proc entries (a benchmark on this machine).

    kumo bench load [--streams 16] [--minutes 2] [--vanish 0.2] [--pairs 300] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from benchmarks.client import DONE, machine, percentile, spawn_serve, sse_data

ROOT = Path(__file__).resolve().parents[1]
LEGACY = "@cf/kumo/glm-4.5"


@dataclass(frozen=True)
class Serve:
    process: subprocess.Popen[str]
    url: str
    account: str
    token: str
    models: list[str]


@dataclass(frozen=True)
class BackendProc:
    pid: int
    name: str
    url: str
    secret: str


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def backends_of(pid: int) -> list[BackendProc]:
    """`kumo serve`'s backend children: name, port (argv) and secret (environment)."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if int(stat.read_text().rsplit(")", 1)[1].split()[1]) != pid:
                continue
            argv = (stat.parent / "cmdline").read_bytes().decode().split("\0")
            env = dict(
                kv.split("=", 1)
                for kv in (stat.parent / "environ").read_bytes().decode().split("\0")
                if "=" in kv
            )
        except OSError:
            continue
        if "backend" in argv:
            name, port = argv[argv.index("--name") + 1], argv[argv.index("--port") + 1]
            out.append(
                BackendProc(
                    int(stat.parent.name), name, f"http://127.0.0.1:{port}", env["KUMO_BACKEND_SECRET"]
                )
            )
    return sorted(out, key=lambda b: b.name)


def start_serve(data_dir: Path) -> Serve:
    legacy = data_dir / "glm-4.5"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    env.pop("KUMO_ADMIN_TOKEN", None)
    if not (legacy / "config.json").is_file():
        subprocess.run(
            [sys.executable, "-m", "backend.tools.random_checkpoint", "glm-4.5", str(legacy)],
            env=env,
            check=True,
        )
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process, text = spawn_serve(
        ["--port", str(port), "--data-dir", str(data_dir), "--legacy-model", f"{LEGACY}={legacy}"],
        env={**env, "KUMO_LOG_JSON": "1"}, stderr=(data_dir / "serve.log").open("ab"),
    )  # fmt: skip
    account = re.search(r"Account ID: ([0-9a-f]{32})", text)
    token = re.search(r"API token:  (\S+)", text)
    models = re.search(r"\(models: ([^;]+);", text)
    assert account and token and models, text
    return Serve(
        process, f"http://127.0.0.1:{port}", account.group(1), token.group(1), models.group(1).split(", ")
    )


# ---- 1. load ---------------------------------------------------------------------------------------------
async def client_loop(
    serve: Serve, http: httpx.AsyncClient, until: float, vanish: float, seed: int
) -> Counter[str]:
    rng = random.Random(seed)
    outcome: Counter[str] = Counter()
    auth = {"authorization": f"Bearer {serve.token}"}
    while time.monotonic() < until:
        model = rng.choice(serve.models)
        body = {
            "messages": [{"role": "user", "content": f"Tell me about {rng.randrange(10**6)}"}],
            "max_tokens": rng.randint(8, 48),
            "stream": True,
        }
        if model != LEGACY:  # the OpenAI family: answer without a reasoning preamble
            body["chat_template_kwargs"] = {"enable_thinking": False}
        leave_after = rng.randint(1, 4) if rng.random() < vanish else None
        url = f"{serve.url}/client/v4/accounts/{serve.account}/ai/run/{model}"
        try:
            async with http.stream("POST", url, headers=auth, json=body) as r:
                if r.status_code != 200:
                    outcome[f"http_{r.status_code}"] += 1
                    await r.aread()
                    continue
                num_frames, state = 0, "cut_short"  # a stream that ends without [DONE] is an error
                async for data in sse_data(r):
                    num_frames += 1
                    if data == DONE:
                        state = "done"
                        break
                    if '"errors"' in data or '"error"' in data:
                        state = "error_frame"
                        break
                    if leave_after is not None and num_frames >= leave_after:
                        state = "vanished"  # the client vanishes: the connection is dropped here
                        break
                outcome[state] += 1
        except httpx.HTTPError as exc:
            outcome[f"transport_{type(exc).__name__}"] += 1
    return outcome


async def backend_load(http: httpx.AsyncClient, b: BackendProc) -> dict[str, int]:
    r = await http.get(f"{b.url}/v1/load", headers={"authorization": f"Bearer {b.secret}"})
    return dict(r.json())


async def wait_idle(
    http: httpx.AsyncClient, backends: list[BackendProc], timeout_s: float = 60
) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    while True:
        loads = {b.name: await backend_load(http, b) for b in backends}
        idle = all(
            x["running"] == 0 and x["waiting"] == 0 and x["free_pages"] == x["total_pages"]
            for x in loads.values()
        )
        if idle or time.monotonic() > deadline:
            return {"is_idle": idle, "loads": loads}
        await asyncio.sleep(0.5)


async def run_load(serve: Serve, streams: int, minutes: float, vanish: float) -> dict[str, object]:
    backends = backends_of(serve.process.pid)
    limits = httpx.Limits(max_connections=streams * 2, max_keepalive_connections=streams)
    async with httpx.AsyncClient(timeout=120, limits=limits, trust_env=False) as http:
        await client_loop(serve, http, time.monotonic() + 5, 0.0, 0)  # warm-up
        before = {"gateway": rss_mib(serve.process.pid), **{b.name: rss_mib(b.pid) for b in backends}}
        started = time.monotonic()
        until = started + minutes * 60
        counts = await asyncio.gather(
            *(client_loop(serve, http, until, vanish, i + 1) for i in range(streams))
        )
        elapsed = time.monotonic() - started
        total: Counter[str] = sum(counts, Counter())
        idle = await wait_idle(http, backends)
    after = {"gateway": rss_mib(serve.process.pid), **{b.name: rss_mib(b.pid) for b in backends}}
    errors = {k: v for k, v in total.items() if k not in ("done", "vanished")}
    return {
        "streams": streams,
        "minutes": minutes,
        "vanish_share": vanish,
        "elapsed_s": round(elapsed, 1),
        "outcomes": dict(total),
        "num_errors": sum(errors.values()),
        "requests_per_s": round(sum(total.values()) / elapsed, 2),
        "rss_mib_before": {k: round(v, 1) for k, v in before.items()},
        "rss_mib_after": {k: round(v, 1) for k, v in after.items()},
        "rss_growth_mib": {k: round(after[k] - before[k], 1) for k in before},
        "after_load": idle,
    }


# ---- 2. overhead -----------------------------------------------------------------------------------------
async def run_overhead(serve: Serve, pairs: int) -> dict[str, object]:
    backend = next(b for b in backends_of(serve.process.pid) if b.name == LEGACY)
    message = [{"role": "user", "content": "Hello, how are you?"}]
    direct_body = {
        "request_id": "bench",
        "tenant_salt": "0" * 64,
        "messages": message,
        "sampling": {"max_tokens": 1, "temperature": 0.0},
    }
    gateway_body = {"messages": message, "max_tokens": 1, "temperature": 0.0}
    gateway_url = f"{serve.url}/client/v4/accounts/{serve.account}/ai/run/{LEGACY}"
    direct, through, added = [], [], []
    async with httpx.AsyncClient(timeout=60, trust_env=False) as http:

        async def straight() -> float:
            t = time.perf_counter()
            r = await http.post(
                f"{backend.url}/v1/generate",
                json=direct_body,
                headers={"authorization": f"Bearer {backend.secret}"},
            )
            assert r.status_code == 200 and '"finish"' in r.text, r.text
            return time.perf_counter() - t

        async def gateway() -> float:
            t = time.perf_counter()
            r = await http.post(
                gateway_url, json=gateway_body, headers={"authorization": f"Bearer {serve.token}"}
            )
            assert r.status_code == 200, r.text
            return time.perf_counter() - t

        for _ in range(10):  # warm both paths (prefix caches, connections)
            await straight()
            await gateway()
        for i in range(pairs):
            first, second = (straight, gateway) if i % 2 == 0 else (gateway, straight)
            a, b = await first(), await second()
            d, g = (a, b) if first is straight else (b, a)
            direct.append(d * 1000)
            through.append(g * 1000)
            added.append((g - d) * 1000)
    ms = lambda v: round(v, 3)  # noqa: E731
    return {
        "pairs": pairs,
        "request": "legacy model, 1 output token, greedy, one at a time, order alternating per pair",
        "direct_ms": {"p50": ms(percentile(direct, 0.5)), "p99": ms(percentile(direct, 0.99))},
        "gateway_ms": {"p50": ms(percentile(through, 0.5)), "p99": ms(percentile(through, 0.99))},
        "added_ms": {
            "p50": ms(percentile(added, 0.5)),
            "p99": ms(percentile(added, 0.99)),
            "mean": ms(statistics.fmean(added)),
        },
    }


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="kumo bench load", description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--minutes", type=float, default=2.0)
    parser.add_argument("--vanish", type=float, default=0.2, help="share of clients that vanish mid-stream")
    parser.add_argument("--pairs", type=int, default=300, help="overhead: direct/gateway request pairs")
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="kumo serve's data dir (default: a temp dir)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--note", default="", help="recorded with the results (e.g. what else the machine ran)"
    )
    args = parser.parse_args(argv)
    data_dir = args.data_dir or Path(tempfile.mkdtemp(prefix="kumo-bench-"))
    serve = start_serve(data_dir)
    try:
        load = asyncio.run(run_load(serve, args.streams, args.minutes, args.vanish))
        overhead = asyncio.run(run_overhead(serve, args.pairs))
    finally:
        serve.process.terminate()
        serve.process.wait(60)
    result = {
        "command": "OMP_NUM_THREADS=1 kumo bench load " + " ".join(argv),
        "machine": machine(),
        "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "note": args.note,
        "load": load,
        "overhead": overhead,
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0 if load["num_errors"] == 0 and load["after_load"]["is_idle"] else 1  # type: ignore[index]

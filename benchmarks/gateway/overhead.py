"""What the gateway adds to a request: latency and throughput against a scripted backend.

The same fake backend (tests/gateway/fake_backend.py: instant, scripted events) is called
directly over the internal protocol and through the gateway's `/ai/run` (auth, quotas, decode,
normalise, route, render, metering with SQLite), so the difference is the gateway's own cost.
Client, gateway and backend share one process and one event loop here, so the figures are a
pessimistic bound (every HTTP hop's parsing is paid on the same core).

    python -m benchmarks.gateway.overhead [--requests 400] [--concurrency 32] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import httpx
import msgspec

from gateway.app import create_app
from gateway.catalog import Catalog, load_catalog_file
from gateway.observability import configure_logging
from gateway.services import open_services
from gateway.settings import GatewaySettings
from schemas.backend import GenerateRequest, Message
from schemas.catalog import PoolsFile, PoolSpec
from tests.gateway.fake_backend import FakeBackend, serve

GLM = "@cf/zai-org/glm-5.2"


async def timed(n: int, concurrency: int, call: Callable[[int], Awaitable[None]]) -> dict[str, float]:
    latencies: list[float] = []
    queue = iter(range(n))

    async def worker() -> None:
        for i in queue:
            t0 = time.perf_counter()
            await call(i)
            latencies.append(time.perf_counter() - t0)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    q = statistics.quantiles(latencies, n=100)
    return {"p50_ms": q[49] * 1e3, "p95_ms": q[94] * 1e3, "requests_per_s": n / wall}


async def main_async(num_requests: int, concurrency: int) -> dict[str, object]:
    backends = [
        FakeBackend("kimi", secret="s"),
        FakeBackend("glm", secret="s", architecture="GlmMoeDsaForCausalLM", vision=False),
    ]
    served = [await serve(b.app()) for b in backends]
    pools = PoolsFile(
        pools={
            "kimi-k2.6": PoolSpec(replicas=[served[0].url], secret="s"),
            "glm-5.2": PoolSpec(replicas=[served[1].url], secret="s"),
        }
    )
    with tempfile.TemporaryDirectory() as tmp:
        settings = GatewaySettings(data_dir=Path(tmp))
        services = await open_services(settings, Catalog.from_file(load_catalog_file(None)), pools)
        account, token = await services.store.ensure_dev_tenant()
        gateway = await serve(create_app(settings, services))
        results: dict[str, object] = {}
        async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=concurrency)) as http:
            body = msgspec.json.encode(
                GenerateRequest(
                    request_id="bench",
                    tenant_salt="ab" * 16,
                    messages=[Message(role="user", content="hello")],
                )
            )

            async def direct(i: int) -> None:
                r = await http.post(
                    f"{served[1].url}/v1/generate", content=body, headers={"authorization": "Bearer s"}
                )
                assert r.status_code == 200

            async def via_gateway(i: int) -> None:
                url = f"{gateway.url}/client/v4/accounts/{account}/ai/run/{GLM}"
                r = await http.post(
                    url, json={"prompt": "hello"}, headers={"authorization": f"Bearer {token}"}
                )
                assert r.status_code == 200, r.text

            for name, call in (("direct", direct), ("gateway", via_gateway)):
                await timed(min(50, num_requests), concurrency, call)  # warm up
                results[name] = {c: await timed(num_requests, c, call) for c in (1, concurrency)}
        await gateway.stop()
    for s in served:
        await s.stop()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    configure_logging(json=True)  # as the commands run it: one JSON line per request, on stderr
    results = asyncio.run(main_async(args.requests, args.concurrency))
    conditions = {
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "one_process": True,
    }
    report = {
        "benchmark": "gateway-overhead",
        "requests": args.requests,
        "conditions": conditions,
        "results": results,
    }
    text = json.dumps(report, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()

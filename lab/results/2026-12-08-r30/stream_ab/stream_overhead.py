"""A streamed request's time through the gateway against the fake backend (~200 delta events a
request), the tree on PYTHONPATH being the variant: one run prints a JSON line.

    PYTHONPATH=<tree> OMP_NUM_THREADS=1 python lab/results/2026-12-08-r30/stream_ab/stream_overhead.py
"""

from __future__ import annotations

import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

from gateway.app import create_app
from gateway.catalog import Catalog, load_catalog_file
from gateway.observability import configure_logging
from gateway.services import open_services
from gateway.settings import GatewaySettings
from schemas.catalog import PoolsFile, PoolSpec
from tests.gateway.fake_backend import FakeBackend, serve

GLM = "@cf/zai-org/glm-5.2"


async def main() -> None:
    configure_logging(json=True)  # as the commands run it (stderr, discarded here)
    backend = FakeBackend("glm", secret="s", architecture="GlmMoeDsaForCausalLM", vision=False)
    served = await serve(backend.app())
    kimi = await serve(FakeBackend("kimi", secret="s").app())
    pools = PoolsFile(
        pools={
            "glm-5.2": PoolSpec(replicas=[served.url], secret="s"),
            "kimi-k2.6": PoolSpec(replicas=[kimi.url], secret="s"),
        }
    )
    out: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        settings = GatewaySettings(data_dir=Path(tmp))
        services = await open_services(settings, Catalog.from_file(load_catalog_file(None)), pools)
        account, token = await services.store.ensure_dev_tenant()
        gateway = await serve(create_app(settings, services))
        url = f"{gateway.url}/client/v4/accounts/{account}/ai/run/{GLM}"
        body = {"prompt": "x" * 600, "stream": True, "max_tokens": 1000}
        async with httpx.AsyncClient(timeout=60) as http:

            async def one() -> tuple[float, int]:
                t0 = time.perf_counter()
                n = 0
                async with http.stream(
                    "POST", url, json=body, headers={"authorization": f"Bearer {token}"}
                ) as r:
                    async for line in r.aiter_lines():
                        n += line.startswith("data: ")
                return time.perf_counter() - t0, n

            for _ in range(20):  # warm
                await one()
            for c in (1, 8):
                t0 = time.perf_counter()
                results: list[tuple[float, int]] = []

                async def worker(results: list[tuple[float, int]] = results, c: int = c) -> None:
                    for _ in range(40 // c if c > 1 else 60):
                        results.append(await one())

                await asyncio.gather(*(worker() for _ in range(c)))
                wall = time.perf_counter() - t0
                lat = [x for x, _ in results]
                out[f"c{c}"] = {
                    "median_ms": round(statistics.median(lat) * 1000, 2),
                    "frames_per_s": round(sum(n for _, n in results) / wall),
                    "frames": results[0][1],
                }
        await gateway.stop()
    await served.stop()
    await kimi.stop()
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

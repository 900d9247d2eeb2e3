"""Services: everything a request handler needs, built once per app and kept on `app.state`.

No module-global state: tests build their own (a fake backend pool, a temporary store), and two
apps in one process never share anything.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

import httpx
import structlog

from gateway.auth import Authenticator
from gateway.backend_client import BackendClient
from gateway.batch import BatchWorker
from gateway.catalog import Catalog, CatalogError
from gateway.images import ImageFetcher, ImageLimits
from gateway.inference import InferenceService
from gateway.lifecycle import Lifecycle
from gateway.observability import Metrics
from gateway.pools import Pool, Replica, Router
from gateway.quotas import Limiter, make_limiter
from gateway.settings import GatewaySettings
from gateway.store import Store
from gateway.usage import UsageLedger
from schemas.catalog import PoolsFile

log = structlog.get_logger("kumo.services")


@dataclass
class Services:
    settings: GatewaySettings
    catalog: Catalog
    router: Router
    store: Store
    authenticator: Authenticator
    limiter: Limiter
    ledger: UsageLedger
    images: ImageFetcher
    metrics: Metrics
    http: httpx.AsyncClient  # outbound fetches (image URLs); backends have their own client
    lifecycle: Lifecycle = field(default_factory=Lifecycle)
    batch: BatchWorker = field(default_factory=BatchWorker)

    @property
    def inference(self) -> InferenceService:
        """The inference service over these services (no HTTP in it)."""
        return InferenceService(
            settings=self.settings,
            catalog=self.catalog,
            router=self.router,
            limiter=self.limiter,
            ledger=self.ledger,
            images=self.images,
            lifecycle=self.lifecycle,
        )

    async def start(self) -> None:
        await self.ledger.start()
        await self.router.start()
        await self.batch.start(self)

    async def stop(self) -> None:
        await self.batch.stop()
        await self.router.stop()
        await self.ledger.stop()
        await self.limiter.close()
        await self.http.aclose()
        await self.router.client.aclose()
        await self.store.close()


def image_fetcher(settings: GatewaySettings) -> tuple[httpx.AsyncClient, ImageFetcher]:
    """The outbound client for image URLs: no redirects followed (each hop is checked by hand),
    no proxies from the environment, and the settings' limits."""
    http = httpx.AsyncClient(follow_redirects=False, trust_env=False, timeout=settings.image_fetch_timeout_s)
    limits = ImageLimits(
        max_bytes=settings.max_image_bytes,
        max_pixels=settings.max_image_pixels,
        timeout_s=settings.image_fetch_timeout_s,
        max_redirects=settings.image_max_redirects,
        allow_private=settings.allow_private_urls,
        allowed_networks=tuple(ipaddress.ip_network(n) for n in settings.allowed_image_networks),
    )
    return http, ImageFetcher(http, limits)


async def open_services(settings: GatewaySettings, catalog: Catalog, pools: PoolsFile) -> Services:
    """Open the store (migrating it), and build every service from the settings and files.
    Every catalog entry's pool must be in the pools file."""
    missing = sorted({m.pool for m in catalog.models} - set(pools.pools))
    if missing:
        raise CatalogError(f"pools file has no pool named {', '.join(missing)}")
    store = Store()
    await store.open(settings.effective_database_url)
    secret_for = {url: spec.secret for spec in pools.pools.values() for url in spec.replicas}
    backend_http = httpx.AsyncClient(
        trust_env=False,
        timeout=httpx.Timeout(settings.backend_read_timeout_s, connect=settings.backend_connect_timeout_s),
        limits=httpx.Limits(max_connections=1000, max_keepalive_connections=100),
    )
    by_pool = {m.pool: m for m in catalog.models}
    router = Router(
        {
            name: Pool(name, by_pool[name], [Replica(url) for url in spec.replicas])
            for name, spec in pools.pools.items()
            if name in by_pool
        },
        BackendClient(backend_http, secret_for),
        health_interval_s=settings.health_interval_s,
        eject_after_failures=settings.eject_after_failures,
    )
    http, images = image_fetcher(settings)
    limiter = make_limiter(settings.redis_url, store)
    problem = await limiter.check()
    if problem is not None:  # served anyway (it may come back), but not in silence
        log.warning(
            "quota_redis_unreachable",
            error=problem,
            consequence="every request is refused 503/3040 until the Redis at KUMO_REDIS_URL answers",
        )
    return Services(
        settings=settings,
        catalog=catalog,
        router=router,
        store=store,
        authenticator=Authenticator(store),
        limiter=limiter,
        ledger=UsageLedger(store),
        images=images,
        metrics=Metrics(),
        http=http,
    )

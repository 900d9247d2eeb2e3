"""`kumo gateway --catalog FILE --pools FILE [--database-url …] [--redis-url …] [--port N]`:
a gateway alone, for scale-out behind a load balancer (backends registered in the pools file)."""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
from http import HTTPStatus
from pathlib import Path

import msgspec
import uvicorn

from gateway.app import create_app, error_response
from gateway.catalog import Catalog, CatalogError, load_catalog_file
from gateway.errors import BadInput, HeadersTooLarge, KumoError, Timeout, Unavailable
from gateway.lifecycle import ABORT_GRACE_S, DrainingServer
from gateway.observability import configure_logging
from gateway.pools import read_pools_file
from gateway.services import Services, open_services
from gateway.settings import GatewaySettings, add_common_arguments, settings_from
from schemas.http_protocol import ConnectionLimits, ServerConfig

DEFAULT_PORT = 8787


_REFUSALS: dict[HTTPStatus, type[KumoError]] = {
    HTTPStatus.BAD_REQUEST: BadInput,
    HTTPStatus.REQUEST_TIMEOUT: Timeout,
    HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE: HeadersTooLarge,
    HTTPStatus.SERVICE_UNAVAILABLE: Unavailable,
}


def refusal(status: HTTPStatus, message: str) -> tuple[list[tuple[bytes, bytes]], bytes]:
    """The connection limits' answers (400, 408, 431, 503: before the app) in the API's error envelope,
    with the same retry headers as the app's own."""
    response = error_response(_REFUSALS[status](message))
    return [(k, v) for k, v in response.raw_headers if k != b"content-length"], bytes(response.body)


def uvicorn_config(app: object, settings: GatewaySettings) -> uvicorn.Config:
    """The HTTP server: connections capped, request heads bounded in time and size, keep-alive
    capped (`schemas.http_protocol`), no access log (the app logs one line per request)."""
    limits = ConnectionLimits(
        header_timeout_s=settings.header_timeout_s,
        max_header_bytes=settings.max_header_bytes,
        max_connections=settings.max_connections,
        max_connections_per_client=settings.max_connections_per_client,
    )
    return ServerConfig(
        app,
        limits,
        refusal=refusal,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        timeout_keep_alive=settings.keep_alive_timeout_s,
        timeout_graceful_shutdown=math.ceil(settings.drain_timeout_s + ABORT_GRACE_S),
        lifespan="on",
        ws="none",
    )


async def prepare(services: Services, settings: GatewaySettings) -> None:
    """Print a generated admin token once (the store keeps only its hash)."""
    generated = await services.store.ensure_admin_token(settings.admin_token)
    if generated is not None:
        print(f"Admin token (shown once): {generated}", flush=True)


async def _run(settings: GatewaySettings, catalog: Catalog, pools_text: str) -> int:
    services = await open_services(settings, catalog, read_pools_file(pools_text))
    await prepare(services, settings)
    server = DrainingServer(
        uvicorn_config(create_app(settings, services), settings), services.lifecycle, settings.drain_timeout_s
    )
    await server.serve()
    return 0


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="kumo gateway", description="Run a gateway in front of backend pools."
    )
    parser.add_argument("--catalog", type=Path, default=None, help="catalog TOML (default: the packaged one)")
    parser.add_argument("--pools", type=Path, required=True, help="pools TOML: [pools.NAME] replicas, secret")
    add_common_arguments(parser, default_port=DEFAULT_PORT)
    args = parser.parse_args(argv)
    settings = settings_from(args, catalog_file=args.catalog, pools_file=args.pools)
    configure_logging(json=settings.log_json)
    try:
        catalog = Catalog.from_file(load_catalog_file(settings.catalog_file))
        pools_text = args.pools.read_text()
        settings.data_dir.mkdir(parents=True, exist_ok=True)
        return asyncio.run(_run(settings, catalog, pools_text))
    except (CatalogError, OSError, msgspec.ValidationError) as exc:
        print(f"kumo gateway: {exc}", file=sys.stderr)
        return 2

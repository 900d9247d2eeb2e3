"""The gateway's route table: `create_app(settings, services)` composes everything.

Public paths follow Workers AI (`/client/v4/accounts/{account_id}/ai/...`); the admin API is mounted
under `/admin/v1`. Every error leaves as the v4 envelope with its Workers AI code: the gateway's own
errors through `render_error`, Starlette's 404/405 as 7000/7001, anything unexpected as a bare 500
"Unknown internal error" (logged here with its traceback, never sent).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib import resources
from pathlib import Path

import msgspec
import structlog
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.templating import Jinja2Templates

from gateway import catalog_routes, openai_compat, openapi, run
from gateway.admin import admin_routes
from gateway.errors import KumoError, MethodNotAllowed, NotFound, retry_headers
from gateway.lifecycle import DrainGate
from gateway.observability import AccessLog, info_of
from gateway.services import Services
from gateway.settings import GatewaySettings
from schemas.workers_ai import Envelope, ErrorItem

log = structlog.get_logger("kumo.gateway")
ACCOUNT = "/client/v4/accounts/{account_id}"


def error_response(exc: KumoError) -> Response:
    body = Envelope(result=None, success=False, errors=[ErrorItem(code=exc.code, message=exc.wire_message)])
    headers = retry_headers(exc)
    return Response(
        msgspec.json.encode(body), status_code=exc.status, headers=headers, media_type="application/json"
    )


async def render_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, KumoError)
    info_of(request.scope).error_code = exc.code
    return error_response(exc)


async def render_http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"{request.method} not supported for requested URI."))
    if exc.status_code == 404:
        return error_response(NotFound("No route for that URI"))
    return error_response(KumoError())


async def render_crash(request: Request, exc: Exception) -> Response:
    log.error("unhandled", path=request.url.path, exc_info=exc)
    return error_response(KumoError("Unknown internal error"))


async def metrics(request: Request) -> Response:
    """Prometheus metrics, behind the admin token (they are platform-wide: every tenant's models,
    request and token counts). A scraper sends it as a bearer token (`authorization.credentials`)."""
    services: Services = request.app.state.services
    await services.authenticator.authenticate_admin(request.headers.get("authorization"))
    return Response(generate_latest(services.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def health(request: Request) -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


def routes(services: Services) -> list[Route | Mount]:
    ai = f"{ACCOUNT}/ai"
    return [
        Route(f"{ai}/run/{{model:path}}", run.run_model, methods=["POST"]),
        Route(f"{ai}/run", run.run_envelope, methods=["POST"]),
        Route(f"{ai}/v1/chat/completions", openai_compat.chat_completions, methods=["POST"]),
        Route(f"{ai}/v1/responses", openai_compat.create_response, methods=["POST"]),
        Route(f"{ai}/v1/models", openai_compat.list_models, methods=["GET"]),
        Route(f"{ai}/v1/models/{{model:path}}", openai_compat.retrieve_model, methods=["GET"]),
        Route(f"{ai}/models/search", catalog_routes.models_search, methods=["GET"]),
        Route(f"{ai}/models/schema", catalog_routes.model_schema, methods=["GET"]),
        Route(f"{ai}/tasks/search", catalog_routes.tasks_search, methods=["GET"]),
        Route(f"{ai}/authors/search", catalog_routes.authors_search, methods=["GET"]),
        Route("/client/v4/memberships", catalog_routes.memberships, methods=["GET"]),
        Route("/models", catalog_routes.models_page, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/healthz", health, methods=["GET"]),
        Route("/openapi.json", openapi.Published(services.catalog.models).respond, methods=["GET"]),
        Mount("/admin/v1", routes=admin_routes(services)),
    ]


def create_app(settings: GatewaySettings, services: Services) -> Starlette:
    """The gateway app. `services` is started and stopped with the app's lifespan."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await services.start()
        try:
            yield
        finally:
            await services.stop()

    app = Starlette(
        routes=routes(services),
        middleware=[
            Middleware(AccessLog, metrics=services.metrics),
            Middleware(DrainGate, lifecycle=services.lifecycle),
        ],
        exception_handlers={
            KumoError: render_error,
            HTTPException: render_http_error,
            Exception: render_crash,
        },
        lifespan=lifespan,
    )
    app.state.services = services
    app.state.templates = Jinja2Templates(directory=str(Path(str(resources.files("gateway"))) / "templates"))
    return app

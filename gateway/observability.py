"""Operations: one structlog JSON line per request, and Prometheus metrics on a per-app registry.

`RequestInfo` lives on the ASGI scope's state; handlers fill in what they learn (tenant, model,
tokens, replica) and `AccessLog` writes the line when the response (stream included) has ended.
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from dataclasses import dataclass, field

import structlog
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

log = structlog.get_logger("kumo.access")


def configure_logging(*, json: bool = True) -> None:
    """Called once by the commands (never at import): JSON lines on stderr."""
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer()
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso"),
            renderer,
        ],
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        wrapper_class=structlog.make_filtering_bound_logger(logging.INFO),
        cache_logger_on_first_use=True,
    )


@dataclass
class RequestInfo:
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    tenant_id: str | None = None
    model: str | None = None
    replica: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    error_code: int | None = None


class Metrics:
    """The gateway's Prometheus metrics, on a registry of its own (no module-global state)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "kumo_gateway_requests",
            "Requests by route kind, model and status",
            ["route", "model", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "kumo_gateway_request_seconds",
            "Time to the end of the response",
            ["route"],
            registry=self.registry,
        )
        self.tokens = Counter(
            "kumo_gateway_tokens", "Tokens served", ["model", "kind"], registry=self.registry
        )
        self.in_flight = Gauge(
            "kumo_gateway_requests_in_flight",
            "Requests being served now (queueing before a handler runs shows here, not in latency)",
            registry=self.registry,
        )


def info_of(scope: Scope) -> RequestInfo:
    state = scope.setdefault("state", {})
    if "kumo" not in state:
        state["kumo"] = RequestInfo()
    info: RequestInfo = state["kumo"]
    return info


class AccessLog:
    """ASGI middleware: request id header, one log line and the metrics for every HTTP request."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        info = info_of(scope)
        started = time.perf_counter()
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message.setdefault("headers", [])
                message["headers"] = [*message["headers"], (b"x-request-id", info.request_id.encode())]
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            self.metrics.in_flight.dec()
            elapsed = time.perf_counter() - started
            route = _route_kind(scope["path"])
            self.metrics.requests.labels(route, info.model or "", str(status)).inc()
            self.metrics.latency.labels(route).observe(elapsed)
            if info.model:
                self.metrics.tokens.labels(info.model, "prompt").inc(info.prompt_tokens)
                self.metrics.tokens.labels(info.model, "completion").inc(info.completion_tokens)
            log.info(
                "request",
                request_id=info.request_id,
                method=scope["method"],
                path=scope["path"],
                status=status,
                tenant=info.tenant_id,
                model=info.model,
                replica=info.replica,
                prompt_tokens=info.prompt_tokens,
                cached_tokens=info.cached_tokens,
                completion_tokens=info.completion_tokens,
                error_code=info.error_code,
                latency_ms=round(elapsed * 1000, 1),
            )


def _route_kind(path: str) -> str:
    for marker, kind in (
        ("/ai/run", "run"),
        ("/ai/v1/", "openai"),
        ("/ai/", "catalog"),
        ("/admin/", "admin"),
    ):
        if marker in path:
            return kind
    return "other"

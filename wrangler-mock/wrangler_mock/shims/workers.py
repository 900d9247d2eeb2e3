"""Shim of the `workers` module of Cloudflare's Python Workers SDK."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import httpx

from wrangler_mock.form_data import Blob, File, FormData
from wrangler_mock.jsvalue import ReadableStream, to_py
from wrangler_mock.request import Request
from wrangler_mock.response import Response


class WorkerEntrypoint:
    """Base of `class Default(WorkerEntrypoint)`: the runtime builds it with `(ctx, env)`."""

    def __init__(self, ctx: Any, env: Any) -> None:
        self.ctx = ctx
        self.env = env


class DurableObject:
    """Base class of a Durable Object (not run by wrangler-mock)."""


class WorkflowEntrypoint:
    """Base class of a Workflow (not run by wrangler-mock)."""


def handler(func: Callable[..., Any]) -> Callable[..., Any]:
    """The SDK's decorator converts a JS Request to `workers.Request`; ours already is one."""
    return func


async def fetch(resource: str, **options: Any) -> Response:
    """Outbound `fetch(url, method=, headers=, body=)` from a Worker, answered with a `Response`."""
    body = options.get("body")
    if isinstance(body, ReadableStream):
        body = await body.bytes()
    headers = to_py(options.get("headers")) or {}
    async with httpx.AsyncClient(follow_redirects=options.get("redirect", "follow") == "follow") as client:
        upstream = await client.request(
            str(options.get("method", "GET")), resource, headers=headers, content=body
        )
    kept = [(k, v) for k, v in upstream.headers.items() if k not in ("content-length", "content-encoding")]
    return Response(upstream.content, upstream.status_code, upstream.reason_phrase, kept)


__all__ = [
    "Blob",
    "DurableObject",
    "File",
    "FormData",
    "Request",
    "Response",
    "WorkerEntrypoint",
    "WorkflowEntrypoint",
    "fetch",
    "handler",
]

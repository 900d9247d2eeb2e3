"""`env.AI`: the Workers AI binding, answered by a gateway through the public REST API.

On Cloudflare the binding talks to an internal endpoint; here each call becomes the REST request
that carries the same meaning (workers-ai-api.md §7.3):

    run(model, inputs, options)
      inputs                      → JSON body of POST …/ai/run/{model}
      options.extraHeaders        → request headers (e.g. x-session-affinity)
      options.gateway             → cf-aig-* headers (id, cacheKey, cacheTtl, skipCache, …)
      options.rejectIfBusy        → body "options": {"rejectIfBusy": true}
      options.queueRequest        → ?queueRequest=true
    returns
      returnRawResponse           → the gateway's response as a `Response`, untouched
      inputs.stream               → a `ReadableStream` of the SSE bytes
      otherwise                   → the envelope's `result` (JS-side values: `.to_py()` works)
    errors                        → `InferenceUpstreamError` with the Workers AI code and message
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx

from wrangler_mock.api import CloudflareApi, error_pairs, unwrap_body
from wrangler_mock.errors import InferenceUpstreamError
from wrangler_mock.jsvalue import JsArray, JsMap, ReadableStream, from_json, to_py
from wrangler_mock.response import Response

MAX_TAGS = 5
MAX_TAG_LENGTH = 50
_TAG_PATTERN = re.compile(r"^[A-Za-z0-9:\-./@]+$")

# option name in `gateway` → AI Gateway request header (ai-gateway/usage/rest-api)
_GATEWAY_HEADERS = {
    "id": "cf-aig-gateway-id",
    "cacheKey": "cf-aig-cache-key",
    "cacheTtl": "cf-aig-cache-ttl",
    "skipCache": "cf-aig-skip-cache",
    "collectLog": "cf-aig-collect-log",
    "eventId": "cf-aig-event-id",
    "requestTimeoutMs": "cf-aig-request-timeout",
}
_RETRY_HEADERS = {
    "maxAttempts": "cf-aig-max-attempts",
    "retryDelayMs": "cf-aig-retry-delay",
    "backoff": "cf-aig-backoff",
}
# headers of the upstream response that describe its transfer, not its content
_HOP_HEADERS = {"content-length", "transfer-encoding", "content-encoding", "connection", "keep-alive"}


def _plain(value: Any, what: str) -> dict[str, Any]:
    """A JS-side argument as a plain dict; a `Map` is refused, since on Cloudflare it serialises to {}."""
    if value is None:
        return {}
    if isinstance(value, JsMap):
        raise TypeError(
            f"{what} is a JS Map: use to_js(..., dict_converter=Object.fromEntries), "
            "otherwise Cloudflare sends it as {}"
        )
    plain = to_py(value)
    if not isinstance(plain, dict):
        raise TypeError(f"{what} must be an object, not {type(plain).__name__}")
    return plain


def _header_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dict | list):
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def gateway_headers(gateway: dict[str, Any]) -> dict[str, str]:
    """The `cf-aig-*` headers that route a REST call through the AI Gateway named in `gateway.id`."""
    if not isinstance(gateway.get("id"), str) or not gateway["id"]:
        raise TypeError("options.gateway.id must be the AI Gateway's id (a non-empty string)")
    headers = {_GATEWAY_HEADERS[k]: _header_value(v) for k, v in gateway.items() if k in _GATEWAY_HEADERS}
    if gateway.get("metadata") is not None:
        headers["cf-aig-metadata"] = _header_value(gateway["metadata"])
    retries = gateway.get("retries") or {}
    headers.update({_RETRY_HEADERS[k]: _header_value(v) for k, v in retries.items() if k in _RETRY_HEADERS})
    return headers


def check_tags(tags: Any) -> None:
    if tags is None:
        return
    if not isinstance(tags, list) or len(tags) > MAX_TAGS:
        raise TypeError(f"options.tags must be a list of at most {MAX_TAGS} tags")
    for tag in tags:
        if not isinstance(tag, str) or len(tag) > MAX_TAG_LENGTH or not _TAG_PATTERN.match(tag):
            raise TypeError(
                f"options.tags: invalid tag {tag!r}: at most {MAX_TAG_LENGTH} characters of [A-Za-z0-9:-./@]"
            )


async def _close(response: httpx.Response) -> None:
    await response.aclose()


def _raw_response(response: httpx.Response, body: bytes | ReadableStream) -> Response:
    headers = [(k, v) for k, v in response.headers.items() if k.lower() not in _HOP_HEADERS]
    return Response(body, response.status_code, response.reason_phrase, headers)


class Ai:
    """The object a Worker reaches as `env.AI` (or whatever `[ai] binding` names it)."""

    def __init__(self, api: CloudflareApi) -> None:
        self._api = api
        self.lastRequestId: str | None = None  # noqa: N815  (the binding's JS name)
        self.aiGatewayLogId: str | None = None  # noqa: N815

    async def run(self, model: str, inputs: Any, options: Any = None) -> Any:
        body = _plain(inputs, "inputs")
        opts = _plain(options, "options")
        if opts.get("websocket"):
            raise TypeError("options.websocket: WebSocket inference is not available through the REST API")
        check_tags(opts.get("tags"))
        headers = {str(k): str(v) for k, v in (opts.get("extraHeaders") or {}).items()}
        if opts.get("gateway") is not None:
            headers.update(gateway_headers(opts["gateway"]))
        if opts.get("rejectIfBusy"):
            body["options"] = {**body.get("options", {}), "rejectIfBusy": True}
        params = {"queueRequest": "true"} if opts.get("queueRequest") else None
        request = await self._api.run_request(model, body, headers=headers, params=params)
        is_stream = bool(body.get("stream"))

        response = await self._api.send(request, stream=True)
        self.lastRequestId = response.headers.get("cf-ai-req-id")
        self.aiGatewayLogId = response.headers.get("cf-aig-log-id")
        if opts.get("returnRawResponse"):
            if is_stream:
                return _raw_response(
                    response, ReadableStream(response.aiter_bytes(), lambda: _close(response))
                )
            return _raw_response(response, await _read(response))
        if not response.is_success:
            raise InferenceUpstreamError(response.status_code, error_pairs(await _read(response)))
        if is_stream:
            return ReadableStream(response.aiter_bytes(), lambda: _close(response))
        content = await _read(response)
        if not response.headers.get("content-type", "").startswith("application/json"):
            return ReadableStream(_once(content))  # binary outputs (images, audio) come back as a stream
        return from_json(unwrap_body(response.status_code, content, InferenceUpstreamError))

    async def models(self, params: Any = None) -> JsArray:
        """`env.AI.models(params)`: one search of the catalog (`search`, `task`, `author`, `page`, …)."""
        entries = await self._api.search_models(_plain(params, "params"), InferenceUpstreamError)
        return JsArray(from_json(entry) for entry in entries)


async def _read(response: httpx.Response) -> bytes:
    try:
        return await response.aread()
    finally:
        await response.aclose()


async def _once(content: bytes) -> AsyncIterator[bytes]:
    yield content

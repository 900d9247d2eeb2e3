"""A small client for the Cloudflare v4 API paths wrangler-mock needs, over httpx.

Both the `ai` commands and the `env.AI` binding go through it, so both send the same auth headers,
build the same account paths and read the v4 envelope (`{result, success, errors, messages}`) the
same way: `result` on success, an `ApiError` (or the subclass the caller names) otherwise.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from wrangler_mock import __version__
from wrangler_mock.errors import ApiError, ConfigError, GatewayUnreachable
from wrangler_mock.settings import Credentials

MODELS_PAGE_SIZE = 50  # wrangler's per_page for `ai models`

# CPU-served models can take a while on long prompts; connecting should not.
DEFAULT_TIMEOUT = httpx.Timeout(600.0, connect=10.0)


def error_pairs(body: bytes) -> list[tuple[int, str]]:
    """The `{code, message}` pairs of an error envelope; a non-JSON body becomes one pair with code 0."""
    try:
        payload = json.loads(body)
    except ValueError:
        text = body.decode("utf-8", "replace").strip()
        return [(0, text)] if text else []
    errors = payload.get("errors") if isinstance(payload, dict) else None
    if not isinstance(errors, list):
        return [(0, body.decode("utf-8", "replace"))]
    return [(int(e.get("code", 0)), str(e.get("message", ""))) for e in errors if isinstance(e, dict)]


def unwrap(response: httpx.Response, error: type[ApiError] = ApiError) -> Any:
    """`result` of a v4 envelope, as wrangler's `fetchResult`: anything but `success: true` raises."""
    return unwrap_body(response.status_code, response.content, error)


def unwrap_body(status: int, body: bytes, error: type[ApiError] = ApiError) -> Any:
    try:
        payload = json.loads(body)
    except ValueError:
        payload = None
    if 200 <= status < 300 and isinstance(payload, dict) and payload.get("success") is True:
        return payload.get("result")
    raise error(status, error_pairs(body))


class CloudflareApi:
    """The v4 API at `credentials.api_base_url`, on one shared `httpx.AsyncClient`."""

    def __init__(self, credentials: Credentials, client: httpx.AsyncClient) -> None:
        self.credentials = credentials
        self.client = client
        self._account_id = credentials.account_id

    @staticmethod
    def make_client(transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=transport,
            timeout=DEFAULT_TIMEOUT,
            headers={"User-Agent": f"wrangler-mock/{__version__}"},
        )

    async def send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        """Send `request`; a transport failure becomes `GatewayUnreachable` naming the URL."""
        try:
            return await self.client.send(request, stream=stream)
        except httpx.TransportError as exc:
            reason = str(exc) or type(exc).__name__
            raise GatewayUnreachable(f"cannot reach {request.url.copy_with(query=None)}: {reason}") from exc

    async def get(self, url: str, params: dict[str, str] | None = None) -> httpx.Response:
        return await self.send(self.client.build_request("GET", url, params=params, headers=self.headers()))

    def url(self, path: str) -> str:
        return f"{self.credentials.api_base_url}/{path.lstrip('/')}"

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {**(extra or {}), **self.credentials.auth_headers()}

    async def account_id(self) -> str:
        """The account to act for: from the environment or wrangler.toml, else the only membership.

        wrangler does the same: without CLOUDFLARE_ACCOUNT_ID it lists `/memberships` and uses the
        account when there is exactly one.
        """
        if self._account_id:
            return self._account_id
        response = await self.get(self.url("memberships"))
        accounts = [m.get("account", {}) for m in unwrap(response) or []]
        ids = [a["id"] for a in accounts if isinstance(a, dict) and a.get("id")]
        if len(ids) != 1:
            raise ConfigError(
                "cannot tell which account to use: set CLOUDFLARE_ACCOUNT_ID or account_id in wrangler.toml"
                + (f" (this token can reach {len(ids)} accounts)" if ids else "")
            )
        self._account_id = ids[0]
        return ids[0]

    async def account_url(self, suffix: str) -> str:
        return self.url(f"accounts/{await self.account_id()}/{suffix.lstrip('/')}")

    async def search_models(
        self, params: dict[str, Any] | None = None, error: type[ApiError] = ApiError
    ) -> list[Any]:
        """One call of `GET …/ai/models/search` with the given query parameters."""
        response = await self.get(await self.account_url("ai/models/search"), _query(params))
        return list(unwrap(response, error) or [])

    async def list_models(self) -> list[Any]:
        """The whole catalog, paged as `wrangler ai models` pages it (50 a page, stop on a short page)."""
        entries: list[Any] = []
        page = 1
        while len(entries) % MODELS_PAGE_SIZE == 0:
            batch = await self.search_models({"per_page": MODELS_PAGE_SIZE, "page": page})
            entries.extend(batch)
            if len(batch) < MODELS_PAGE_SIZE:
                break
            page += 1
        return entries

    async def run_request(
        self,
        model: str,
        body: dict[str, Any],
        *,
        headers: dict[str, str] | None = None,
        params: dict[str, str] | None = None,
    ) -> httpx.Request:
        """`POST …/ai/run/{model}`, the model id pasted raw into the path as wrangler and SDK 4.x do."""
        return self.client.build_request(
            "POST",
            await self.account_url(f"ai/run/{model}"),
            json=body,
            params=params,
            headers=self.headers({"content-type": "application/json", **(headers or {})}),
        )


def _query(params: dict[str, Any] | None) -> dict[str, str]:
    """Query values as the JS binding writes them (`true`/`false`, not Python's `True`)."""
    out: dict[str, str] = {}
    for key, value in (params or {}).items():
        if value is None:
            continue
        out[key] = ("true" if value else "false") if isinstance(value, bool) else str(value)
    return out

"""The `Request` a Worker's `fetch` receives, shaped like `workers.Request` in Cloudflare's Python SDK.

`method` is an `http.HTTPMethod`, `headers` an `http.client.HTTPMessage` (case-insensitive `.get`),
and the body is read once through `json()`, `text()`, `bytes()` or the `body` stream, as in the
runtime, where a second read raises `OSError("Body already used")`.
"""

from __future__ import annotations

import builtins
import http.client
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from http import HTTPMethod
from typing import Any

from wrangler_mock.form_data import FormData, parse_form
from wrangler_mock.jsvalue import ReadableStream, from_json


class Request:
    """An incoming HTTP request; the body comes from `read_body` on first use."""

    def __init__(
        self,
        method: str,
        url: str,
        headers: Iterable[tuple[str, str]],
        read_body: Callable[[], Awaitable[bytes]],
    ) -> None:
        self._method = HTTPMethod(method.upper())
        self._url = url
        self._headers = list(headers)
        self._read_body = read_body
        self.body_used = False

    @property
    def method(self) -> HTTPMethod:
        return self._method

    @property
    def url(self) -> str:
        return self._url

    @property
    def headers(self) -> http.client.HTTPMessage:
        result = http.client.HTTPMessage()
        for key, value in self._headers:
            result[key] = value
        return result

    @property
    def body(self) -> ReadableStream:
        async def chunks() -> AsyncIterator[bytes]:
            yield await self.bytes()

        return ReadableStream(chunks())

    async def bytes(self) -> bytes:
        if self.body_used:
            raise OSError("Body already used")
        self.body_used = True
        return await self._read_body()

    async def buffer(self) -> builtins.bytes:
        return await self.bytes()

    async def arrayBuffer(self) -> builtins.bytes:  # noqa: N802  (the JS name, used by older Workers)
        return await self.bytes()

    async def text(self) -> str:
        return (await self.bytes()).decode("utf-8")

    async def form_data(self) -> FormData:
        """The body as form fields (multipart uploads or url-encoded), as `workers.Request.form_data`."""
        return parse_form(await self.bytes(), self.headers.get("content-type", ""))

    async def formData(self) -> FormData:  # noqa: N802  (the JS name)
        return await self.form_data()

    async def json(self, **kwargs: Any) -> Any:
        """The parsed body; objects come back as `JsObject`, so both `d["k"]` and `.to_py()` work."""
        return from_json(json.loads(await self.text(), **kwargs))

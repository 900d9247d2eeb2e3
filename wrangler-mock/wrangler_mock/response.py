"""`Response`, shaped like `workers.Response` (and `js.Response`) in Cloudflare's Python Workers.

A Worker returns one from `fetch`; `env.AI.run(..., {"returnRawResponse": True})` returns one too,
so a Worker can pass the gateway's answer straight through. Bodies are `str`, bytes, `None`, or a
`ReadableStream` (e.g. the SSE stream from `env.AI.run` with `stream: true`).
"""

from __future__ import annotations

import json as _json
from collections.abc import Iterable, Mapping
from http import HTTPStatus
from typing import Any

from wrangler_mock.jsvalue import ReadableStream, from_json, to_py

Body = str | bytes | bytearray | memoryview | ReadableStream | None
HeadersInit = Mapping[str, str] | Iterable[tuple[str, str]] | None


def _header_dict(headers: HeadersInit) -> dict[str, str]:
    """Lower-cased header names, as `FetchResponse.headers` gives them."""
    if headers is None:
        return {}
    pairs = headers.items() if isinstance(headers, Mapping) else headers
    return {str(k).lower(): str(v) for k, v in pairs}


class Response:
    """An HTTP response: status, headers (a dict with lower-cased names) and a one-shot body."""

    def __init__(
        self,
        body: Body = None,
        status: HTTPStatus | int = HTTPStatus.OK,
        status_text: str = "",
        headers: HeadersInit = None,
    ) -> None:
        self.status = int(status)
        if not 200 <= self.status <= 599:
            raise ValueError(
                f"Responses may only be constructed with status codes in the range 200 to 599, got {self.status}"
            )
        self.status_text = status_text or HTTPStatus(self.status).phrase
        self.headers = _header_dict(headers)
        if isinstance(body, str):
            self.headers.setdefault("content-type", "text/plain;charset=UTF-8")
            self._body: bytes | ReadableStream | None = body.encode("utf-8")
        elif isinstance(body, bytes | bytearray | memoryview):
            self._body = bytes(body)
        elif body is None or isinstance(body, ReadableStream):
            self._body = body
        else:
            raise TypeError(
                f"Response body must be str, bytes, a ReadableStream or None, not {type(body).__name__}"
            )
        self.body_used = False

    @property
    def ok(self) -> bool:
        return 200 <= self.status < 300

    @property
    def body(self) -> ReadableStream | bytes | None:
        return self._body

    # `Response.json(data, ...)` builds a JSON response (workers.Response's static method);
    # `await response.json()` on an instance reads the body (what a JS Response proxy offers).
    json: Any

    @staticmethod
    def redirect(url: str, status: HTTPStatus | int = HTTPStatus.FOUND) -> Response:
        if int(status) not in (301, 302, 303, 307, 308):
            raise ValueError(f"Invalid redirect status {int(status)}")
        return Response(None, status, headers={"location": url})

    async def bytes(self) -> bytes:
        if self.body_used:
            raise OSError("Body already used")
        self.body_used = True
        if isinstance(self._body, ReadableStream):
            return await self._body.bytes()
        return self._body or b""

    async def text(self) -> str:
        return (await self.bytes()).decode("utf-8")

    async def _read_json(self) -> Any:
        return from_json(_json.loads(await self.text()))


class _JsonDispatch:
    """Lets `Response.json` be both the static constructor and, on an instance, the body reader."""

    def __get__(self, instance: Response | None, owner: type[Response]) -> Any:
        if instance is None:
            return _json_response
        return instance._read_json


def _json_response(
    data: Any, status: HTTPStatus | int = HTTPStatus.OK, status_text: str = "", headers: HeadersInit = None
) -> Response:
    """`data` serialised to JSON (JS-side values converted first), `content-type: application/json`."""
    response = Response(_json.dumps(to_py(data)), status, status_text, headers)
    response.headers["content-type"] = "application/json"
    return response


Response.json = _JsonDispatch()

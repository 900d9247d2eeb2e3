"""Python stand-ins for the JavaScript values a Python Worker sees through Pyodide's FFI.

In Pyodide a JS object reaches Python as a `JsProxy`: attributes read its properties and
`.to_py()` converts it to plain dicts and lists. Here the JS side does not exist, so a JS object is
a `JsObject` (a dict that also answers attribute access and `.to_py()`), a JS array a `JsArray`,
and a stream of bytes a `ReadableStream`. Worker code written for Cloudflare (`result.to_py()`,
`result.response`, `result["response"]`) runs unchanged on them.

`to_js(d)` without `dict_converter=Object.fromEntries` makes a JS `Map` in Pyodide, which
`JSON.stringify` (and so `env.AI.run`) turns into `{}`; `JsMap` marks that case so the binding can
refuse it loudly instead of sending an empty request.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import anyio


class JsProxy:
    """Marker base of every JS-side value, like `pyodide.ffi.JsProxy`."""

    def to_py(self) -> Any:
        raise NotImplementedError


class JsException(Exception):  # noqa: N818  (Pyodide's name)
    """An error thrown on the JS side, as `pyodide.ffi.JsException`."""

    def __init__(self, name: str, message: str) -> None:
        super().__init__(f"{name}: {message}")
        self.name = name
        self.message = message


class JsObject(dict[str, Any], JsProxy):
    """A plain JS object: a dict whose keys are also readable as attributes."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_py(self) -> dict[str, Any]:
        return {key: to_py(value) for key, value in self.items()}


class JsMap(JsObject):
    """A JS `Map` (what `to_js(dict)` gives without a `dict_converter`)."""


class JsArray(list[Any], JsProxy):
    """A JS array."""

    def to_py(self) -> list[Any]:
        return [to_py(value) for value in self]


class ReadableStream(JsProxy):
    """A one-shot stream of byte chunks (a JS `ReadableStream<Uint8Array>`).

    Iterate it with `async for`, read it whole with `.bytes()`/`.text()`, or hand it to a
    `Response` as the body; `aclose` runs the producer's cleanup (closing an upstream connection).
    """

    def __init__(
        self, chunks: AsyncIterator[bytes], on_close: Callable[[], Awaitable[None]] | None = None
    ) -> None:
        self._chunks = chunks
        self._on_close = on_close
        self.locked = False

    async def __aiter__(self) -> AsyncIterator[bytes]:
        if self.locked:
            raise TypeError("ReadableStream is locked: it has already been read")
        self.locked = True
        try:
            async for chunk in self._chunks:
                yield chunk
        finally:
            await self.aclose()

    async def aclose(self) -> None:
        if self._on_close is not None:
            on_close, self._on_close = self._on_close, None
            # runs while the reader is being cancelled (its client left): the upstream must still close
            with anyio.CancelScope(shield=True):
                await on_close()

    async def bytes(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    async def text(self) -> str:
        return (await self.bytes()).decode("utf-8")

    def to_py(self) -> ReadableStream:
        return self


def to_js(value: Any, *, dict_converter: Callable[..., Any] | None = None, **_: Any) -> Any:
    """Pyodide's `to_js`: dicts become JS objects (with `Object.fromEntries`) or `Map`s (without)."""
    if isinstance(value, JsProxy):
        return value
    if isinstance(value, dict):
        items = {str(k): to_js(v, dict_converter=dict_converter) for k, v in value.items()}
        return JsObject(items) if dict_converter is not None else JsMap(items)
    if isinstance(value, list | tuple):
        return JsArray(to_js(v, dict_converter=dict_converter) for v in value)
    return value


def to_py(value: Any) -> Any:
    """Deep conversion of JS-side values to plain Python (what `.to_py()` does)."""
    return value.to_py() if isinstance(value, JsProxy) else value


def from_json(value: Any) -> Any:
    """Parsed JSON as the JS side would hold it (`JSON.parse` result): objects and arrays proxied."""
    if isinstance(value, dict):
        return JsObject({key: from_json(v) for key, v in value.items()})
    if isinstance(value, list):
        return JsArray(from_json(v) for v in value)
    return value

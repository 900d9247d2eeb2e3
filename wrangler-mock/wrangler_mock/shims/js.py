"""Shim of the `js` module (the JS global scope) for what Python Workers commonly import from it:
`Object.fromEntries` (the `dict_converter` of `to_js`), `JSON`, `console`, `Response`, `Headers`
and `fetch`."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from typing import Any

from wrangler_mock.jsvalue import JsArray, JsObject, from_json, to_py
from wrangler_mock.response import Response as _Response
from wrangler_mock.shims.workers import fetch


class Object:
    @staticmethod
    def fromEntries(entries: Iterable[tuple[Any, Any]]) -> JsObject:  # noqa: N802
        return JsObject((str(k), v) for k, v in entries)

    @staticmethod
    def keys(obj: dict[str, Any]) -> JsArray:
        return JsArray(obj.keys())

    @staticmethod
    def entries(obj: dict[str, Any]) -> JsArray:
        return JsArray(JsArray(item) for item in obj.items())


class JSON:  # noqa: N801
    @staticmethod
    def parse(text: str) -> Any:
        return from_json(json.loads(text))

    @staticmethod
    def stringify(value: Any, _replacer: Any = None, space: int | str | None = None) -> str:
        if space:
            return json.dumps(to_py(value), indent=space)
        return json.dumps(to_py(value), separators=(",", ":"))


class console:  # noqa: N801
    """Worker logs go to stderr, where `wrangler dev` shows them."""

    @staticmethod
    def log(*args: Any) -> None:
        print(*args, file=sys.stderr, flush=True)

    info = debug = warn = error = log


class Headers(JsObject):
    @classmethod
    def new(cls, init: Any = None) -> Headers:
        pairs = init.items() if isinstance(init, dict) else (init or [])
        return cls((str(k).lower(), str(v)) for k, v in pairs)


class Response(_Response):
    """`js.Response`: built with `Response.new(body, init)` from Python."""

    @classmethod
    def new(cls, body: Any = None, init: Any = None, **kwargs: Any) -> _Response:
        options = {**to_py(init or {}), **kwargs}
        return _Response(
            body, options.get("status", 200), options.get("statusText", ""), options.get("headers")
        )


__all__ = ["JSON", "Headers", "Object", "Response", "console", "fetch"]

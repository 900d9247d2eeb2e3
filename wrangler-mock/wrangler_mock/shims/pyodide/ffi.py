"""Shim of `pyodide.ffi`: `to_js`, `JsProxy` (with `.to_py()`), `JsException`, proxy helpers."""

from __future__ import annotations

from typing import Any

from wrangler_mock.jsvalue import JsArray, JsException, JsMap, JsObject, JsProxy, to_js, to_py


def create_proxy(obj: Any, **_: Any) -> Any:
    """There is no JS heap to keep a reference from: the object is its own proxy."""
    return obj


def create_once_callable(obj: Any, **_: Any) -> Any:
    return obj


def destroy_proxies(_proxies: Any) -> None:
    """Nothing to free: `create_proxy` allocates nothing."""


__all__ = [
    "JsArray",
    "JsException",
    "JsMap",
    "JsObject",
    "JsProxy",
    "create_once_callable",
    "create_proxy",
    "destroy_proxies",
    "to_js",
    "to_py",
]

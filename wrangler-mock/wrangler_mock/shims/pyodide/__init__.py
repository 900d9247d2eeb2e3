"""Shim of the `pyodide` package: only `pyodide.ffi` is provided."""

from wrangler_mock.shims.pyodide import ffi

__all__ = ["ffi"]

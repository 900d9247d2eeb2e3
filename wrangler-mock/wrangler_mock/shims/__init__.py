"""Stand-ins for the modules the Python Workers runtime provides: `workers`, `js`, `pyodide.ffi`.

`install()` puts them into `sys.modules` under their runtime names before a Worker is imported, so
`from workers import WorkerEntrypoint, Response` in an unchanged Worker file resolves to them. They
replace any module of the same name: a Worker means the runtime's modules, never a PyPI namesake.
"""

from __future__ import annotations

import sys

from wrangler_mock.shims import js, workers
from wrangler_mock.shims import pyodide as pyodide_shim
from wrangler_mock.shims.pyodide import ffi

MODULES = {"workers": workers, "js": js, "pyodide": pyodide_shim, "pyodide.ffi": ffi}


def install() -> None:
    """Make the runtime module names resolve to the shims (idempotent)."""
    for name, module in MODULES.items():
        sys.modules[name] = module

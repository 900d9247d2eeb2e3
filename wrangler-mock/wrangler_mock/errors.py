"""wrangler-mock's one error tree.

    WranglerMockError
    ├── ConfigError                 wrangler.toml, .dev.vars or credentials unusable
    ├── WorkerLoadError             the Worker module has neither `Default` nor `on_fetch`
    ├── GatewayUnreachable          no answer at all: connection refused, DNS, timeout
    └── ApiError                    the v4 API answered `success: false` (or no envelope at all)
        └── InferenceUpstreamError  what `env.AI.run` raises, as the Workers runtime names it
                                    (also a `pyodide.ffi.JsException`, as on Cloudflare)

`ApiError` keeps every `{code, message}` pair of the envelope; `code`/`message` are the first.
Its text is wrangler's ("Received a bad response from the API" plus `<message> [code: <code>]`
notes); `InferenceUpstreamError`'s text is the runtime's `"<code>: <message>"`, so Worker code that
logs or matches `str(err)` sees what it would see on Cloudflare.
"""

from __future__ import annotations

from wrangler_mock.jsvalue import JsException


class WranglerMockError(Exception):
    """Base of everything wrangler-mock raises on purpose."""


class ConfigError(WranglerMockError):
    """wrangler.toml, .dev.vars or the Cloudflare credentials cannot be used."""


class WorkerLoadError(WranglerMockError):
    """The Worker's main module cannot be loaded or exposes no fetch handler."""


class GatewayUnreachable(WranglerMockError, JsException):
    """The API base URL did not answer (also a `JsException`, so a Worker's `except` sees it)."""

    def __init__(self, message: str) -> None:
        Exception.__init__(self, message)
        self.name = "GatewayUnreachable"
        self.message = message


class ApiError(WranglerMockError):
    """A Cloudflare v4 API call that did not succeed: HTTP status plus the envelope's errors."""

    def __init__(self, status: int, errors: list[tuple[int, str]]) -> None:
        self.status = status
        self.errors = errors or [(0, f"HTTP {status}")]
        self.code, self.message = self.errors[0]
        Exception.__init__(self, self.wrangler_text)  # not super(): a subclass mixes in JsException

    @property
    def wrangler_text(self) -> str:
        """How wrangler reports a failed API call: a headline, then `<message> [code: <code>]` notes."""
        notes = "\n".join(f"  - {message} [code: {code}]" for code, message in self.errors)
        return f"Received a bad response from the API\n{notes}"


class InferenceUpstreamError(ApiError, JsException):
    """`env.AI.run` failed upstream; `str(err)` is `"<code>: <message>"` as in workerd.

    On Cloudflare the binding's errors reach Python as `pyodide.ffi.JsException`, so Worker code
    catches them with `except JsException`; this class is one too. `.code` and `.message` are the
    Workers AI code and message of the envelope's first error.
    """

    name = "InferenceUpstreamError"

    def __init__(self, status: int, errors: list[tuple[int, str]]) -> None:
        ApiError.__init__(self, status, errors)
        Exception.__init__(self, f"{self.code}: {self.message}")

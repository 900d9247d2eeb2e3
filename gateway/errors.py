"""The gateway's one error tree, each class carrying its HTTP status and Workers AI code.

    KumoError (500, Workers AI "Unknown internal error")
    ├── BadInput (400)                 schema/validation failures; message names the failing path
    │   ├── MissingBody (400, 3003)
    │   ├── UnknownModel (400, 5007)
    │   ├── Unsupported (400)          a field or capability this model does not serve
    │   └── InvalidAdminRequest (400, 6007)  admin API body or query; no "AiError: " prefix
    ├── Unauthenticated (401, 10000)
    ├── Forbidden (403, 9109)          a tenant token on an admin route, a model not allowed for the tenant
    │   ├── OtherAccount (403, 10000)  another account's path ("Authentication error", as observed)
    │   ├── Suspended (403, 9109)      the token's account is suspended by an operator
    │   ├── PaidModelOnFreePlan (403, 5035)
    │   └── ModelNotAllowed (403, 5018)
    ├── NoRoute (404, 7003) / NotFound (404, 7000)
    ├── MethodNotAllowed (405, 7001)
    ├── Timeout (408, 3046) / Aborted (408, 3008)
    ├── TooLarge (413, 3006) / ContextWindowExceeded (413, 5021)
    │   └── HeadersTooLarge (431, 3006)  request line and headers over the limit (before the app)
    ├── RateLimited (429, 3021) / NeuronsExhausted (429, 3036) / Busy (429, 3040)
    │   └── OverTokenLimit (429, 3021)   one request over the tokens-per-minute limit: no retry
    └── Unavailable (503, 3040)         no healthy replica

One handler (`render`) turns any of them into the v4 envelope
`{"result": null, "success": false, "errors": [{code, message}], "messages": []}`.
Foreign errors are translated at the edge with `raise ... from exc`.
"""

from __future__ import annotations


class KumoError(Exception):
    status: int = 500
    code: int = 3000
    prefix: str = "AiError: "  # Workers AI prefixes inference errors so; admin errors set ""
    can_retry: bool = True  # for 429/503: whether the same request may succeed later

    def __init__(self, message: str = "Unknown internal error", *, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry_after = retry_after

    @property
    def wire_message(self) -> str:
        return f"{self.prefix}{self.message}" if self.prefix else self.message


class BadInput(KumoError):
    status, code = 400, 5006


class MissingBody(BadInput):
    code = 3003


class UnknownModel(BadInput):
    code = 5007


class Unsupported(BadInput):
    code = 5006


class InvalidAdminRequest(BadInput):
    code, prefix = 6007, ""


class Unauthenticated(KumoError):
    status, code, prefix = 401, 10000, ""


class Forbidden(KumoError):
    status, code, prefix = 403, 9109, ""


class OtherAccount(Forbidden):
    """A valid token on another account's path: Cloudflare answers 403 with code 10000
    `Authentication error` (reference §3.1, observed), not 9109."""

    code = 10000


class Suspended(Forbidden):
    """The token is valid, its account suspended (`PATCH /admin/v1/tenants/{id}` `suspended`)."""


class PaidModelOnFreePlan(Forbidden):
    code, prefix = 5035, "AiError: "


class ModelNotAllowed(Forbidden):
    """The tenant's model allow-list excludes it (Workers AI: private model, 5018)."""

    code, prefix = 5018, "AiError: "


class NotFound(KumoError):
    status, code, prefix = 404, 7000, ""


class NoRoute(NotFound):
    code = 7003


class MethodNotAllowed(KumoError):
    status, code, prefix = 405, 7001, ""


class Timeout(KumoError):
    status, code = 408, 3046


class Aborted(KumoError):
    status, code = 408, 3008


class ClientClosed(KumoError):
    """The client went away before its answer was ready (nginx's 499): nobody reads this response,
    the access log and the usage record say it."""

    status, code = 499, 3008


class TooLarge(KumoError):
    status, code = 413, 3006


class HeadersTooLarge(TooLarge):
    status = 431


class ContextWindowExceeded(KumoError):
    status, code = 413, 5021


class RateLimited(KumoError):
    status, code = 429, 3021


class OverTokenLimit(RateLimited):
    """A request whose token estimate alone exceeds the tenant's tokens per minute: no window
    will ever admit it, so it is not worth retrying."""

    can_retry = False


class NeuronsExhausted(KumoError):
    status, code, can_retry = 429, 3036, False


class Busy(KumoError):
    status, code = 429, 3040


class Unavailable(KumoError):
    status, code = 503, 3040


def retry_headers(exc: KumoError) -> dict[str, str]:
    """`Retry-After` and `x-should-retry` for an error answer. 429 and 503 always say when to come
    back, unless retrying cannot help (`can_retry`): a spent daily allowance (3036) is not worth
    retrying today, a request over the tokens-per-minute limit never. Other 4xx (but 408) are the
    caller's to fix; the cloudflare SDK retries only what may succeed later."""
    headers: dict[str, str] = {}
    if exc.status in (429, 503):
        if exc.retry_after is not None or exc.can_retry:
            headers["retry-after"] = str(exc.retry_after if exc.retry_after is not None else 1)
        headers["x-should-retry"] = "true" if exc.can_retry else "false"
    elif exc.retry_after is not None:
        headers["retry-after"] = str(exc.retry_after)
    if 400 <= exc.status < 500 and exc.status not in (408, 429):
        headers["x-should-retry"] = "false"
    return headers

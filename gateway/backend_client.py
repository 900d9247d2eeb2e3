"""BackendClient: the gateway's one seam to backends, the internal protocol over httpx (DESIGN §3).

It sends the shared secret, decodes NDJSON `Event`s with one msgspec decoder, and translates what
a backend says into the gateway's error tree at this edge: a connection failure or 5xx before the
first byte is a `ReplicaFailed` (the router retries it elsewhere), a backend `Error` becomes the
matching `KumoError`. A backend answers nothing before its first event, which comes once the prompt
is in (`backend/server/app.py`): until then, all the gateway knows is whether the replica has the
request (`Dispatch`).
"""

from __future__ import annotations

import functools
import hashlib
import hmac
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager

import httpx
import msgspec

from gateway import errors
from schemas.backend import Error, ErrorBody, Event, GenerateRequest, Health, LoadReport, ModelCard

MAX_LINE_BYTES = 4 * 1024 * 1024

_ERRORS: dict[str, type[errors.KumoError]] = {
    "invalid_request": errors.BadInput,
    "unauthorized": errors.KumoError,  # our secret is wrong: a deployment fault, not the client's
    "context_window_exceeded": errors.ContextWindowExceeded,
    "too_large_for_pool": errors.TooLarge,
    "busy": errors.Busy,
    "integrity_abort": errors.KumoError,
    "aborted": errors.Aborted,
    "timeout": errors.Timeout,
    "unsupported": errors.Unsupported,
    "internal": errors.KumoError,
}


PROBE_TIMEOUT_S = 5.0  # a health-loop request (`BackendClient._get`)


class ReplicaFailed(Exception):
    """A replica could not take the request (down, 5xx, busy) before sending anything; retryable."""

    def __init__(self, url: str, reason: str, *, error: errors.KumoError | None = None) -> None:
        super().__init__(f"{url}: {reason}")
        self.url = url
        self.error = error


class Dispatch:
    """Whether a replica holds one backend request: set once the request's whole body has been sent
    to it, cleared when the replica refuses it (an error answer) or the connection fails. Read at a
    cut before the first event (the deadline, a drain, the caller gone): a replica that held the
    request may have been prefilling it, and the pages it computed stay in its prefix cache."""

    def __init__(self) -> None:
        self.is_held = False


def to_gateway_error(error: Error) -> errors.KumoError:
    """A backend error event → the gateway error with the Workers AI code and status."""
    cls = _ERRORS.get(error.code, errors.KumoError)
    if cls is errors.KumoError:
        return errors.KumoError("Unknown internal error")  # never leak backend internals
    if cls is errors.Busy:
        return errors.Busy("Capacity temporarily exceeded, please try again.", retry_after=1)
    return cls(error.message)


@functools.lru_cache(maxsize=65536)  # one HMAC per tenant, not per request
def tenant_salt(server_secret: str, tenant_id: str) -> str:
    """The prefix-cache salt of a tenant: HMAC-SHA256(server secret, tenant id), hex. Derived here,
    never taken from a request, so tenants can never share (or probe) each other's cache."""
    return hmac.new(server_secret.encode(), tenant_id.encode(), hashlib.sha256).hexdigest()


class BackendClient:
    """Speaks the internal protocol to any replica; one httpx pool shared by all of them."""

    def __init__(self, http: httpx.AsyncClient, secret_for: dict[str, str]) -> None:
        self._http = http
        self._secret_for = secret_for  # replica url → shared secret
        self._events = msgspec.json.Decoder(Event)
        self._error_body = msgspec.json.Decoder(ErrorBody)

    async def aclose(self) -> None:
        await self._http.aclose()

    def _headers(self, url: str) -> dict[str, str]:
        return {"authorization": f"Bearer {self._secret_for[url]}"}

    async def _get(self, url: str, path: str, decoder: type) -> object:
        """A health-loop probe (health, load, card): it gives up after `PROBE_TIMEOUT_S` (httpx closes
        the connection), not the generation read timeout (600 s: a replica that accepts and never
        answers held its checks that long)."""
        response = await self._http.get(f"{url}{path}", headers=self._headers(url), timeout=PROBE_TIMEOUT_S)
        response.raise_for_status()
        return msgspec.json.decode(response.content, type=decoder)

    async def model_card(self, url: str) -> ModelCard:
        card = await self._get(url, "/v1/model", ModelCard)
        assert isinstance(card, ModelCard)
        return card

    async def load(self, url: str) -> LoadReport:
        report = await self._get(url, "/v1/load", LoadReport)
        assert isinstance(report, LoadReport)
        return report

    async def health(self, url: str) -> Health:
        health = await self._get(url, "/v1/health", Health)
        assert isinstance(health, Health)
        return health

    @asynccontextmanager
    async def generate(
        self, url: str, request: GenerateRequest, dispatch: Dispatch | None = None
    ) -> AsyncIterator[AsyncIterator[Event]]:
        """Open `POST /v1/generate`; yields an iterator of events. Leaving the context closes the
        connection, which aborts the request in the engine (DESIGN §3). `dispatch` is told when the
        replica has the whole request (httpx's `trace` extension) and when it gives it back."""
        body = msgspec.json.encode(request)
        headers = {**self._headers(url), "content-type": "application/json"}
        held = dispatch if dispatch is not None else Dispatch()

        async def trace(event: str, info: Mapping[str, object]) -> None:
            if event.endswith(".send_request_body.complete"):  # http11. or http2.
                held.is_held = True

        extensions = {"trace": trace}
        try:
            async with self._http.stream(
                "POST", f"{url}/v1/generate", content=body, headers=headers, extensions=extensions
            ) as resp:
                if resp.status_code != 200:
                    held.is_held = False
                    raw = await resp.aread()
                    error = self._decode_error(raw, resp.status_code)
                    if resp.status_code >= 500 or error.code == "busy":
                        raise ReplicaFailed(url, f"HTTP {resp.status_code}", error=to_gateway_error(error))
                    raise to_gateway_error(error)
                yield self._lines(resp)
        except httpx.TransportError as exc:
            held.is_held = False
            raise ReplicaFailed(url, type(exc).__name__) from exc

    def _decode_error(self, raw: bytes, status: int) -> Error:
        try:
            return self._error_body.decode(raw).error
        except msgspec.DecodeError:
            return Error(code="internal", message=f"backend answered HTTP {status}", status=status)

    async def _lines(self, resp: httpx.Response) -> AsyncIterator[Event]:
        """One event per NDJSON line; a line is refused as soon as it passes `MAX_LINE_BYTES`,
        so a runaway backend cannot make the gateway buffer without bound."""
        pending = bytearray()
        async for chunk in resp.aiter_raw():
            pending += chunk
            while (end := pending.find(b"\n")) >= 0:
                line = bytes(pending[:end])
                del pending[: end + 1]
                if line.strip():
                    yield self._event(line)
            if len(pending) > MAX_LINE_BYTES:
                raise errors.KumoError("Unknown internal error")
        if pending.strip():
            yield self._event(bytes(pending))

    def _event(self, line: bytes) -> Event:
        if len(line) > MAX_LINE_BYTES:
            raise errors.KumoError("Unknown internal error")
        try:
            return self._events.decode(line)
        except msgspec.DecodeError as exc:
            raise errors.KumoError("Unknown internal error") from exc

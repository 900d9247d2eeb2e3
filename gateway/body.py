"""The request body: read under a size limit and a deadline, then decoded with a typed decoder.

The limit holds while the body streams in (a declared `content-length` over it is refused before
any byte is read), so a 30 GB body costs nothing (reliability §4.3); a client that trickles its
body is cut off at the deadline (§4.5). Decode errors name the failing path.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
from starlette.requests import Request

from gateway.errors import BadInput, MissingBody, Timeout, TooLarge


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413/3006 as soon as it passes `limit` (never read whole first), and
    408 when a slow client has not sent it within `timeout_s`."""
    declared = request.headers.get("content-length")
    if declared and declared.isdigit() and int(declared) > limit:
        raise TooLarge("Request is too large")
    body = bytearray()
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                body += chunk
                if len(body) > limit:
                    raise TooLarge("Request is too large")
    except TimeoutError as exc:
        raise Timeout("Request timeout") from exc
    if not body.strip():
        raise MissingBody("Request is missing headers or body: body")
    return bytes(body)


def decode(raw: bytes, decoder: msgspec.json.Decoder[Any]) -> object:
    """Typed decode; the 400 names the failing path (`$.messages[0].content`)."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        raise BadInput(f"Bad input: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise BadInput("Bad input: the body is not valid JSON") from exc
    except RecursionError as exc:
        raise BadInput("Bad input: the body is nested too deeply") from exc

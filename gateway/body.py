"""The request body: read under a size limit and a deadline, then decoded with a typed decoder.

The limit holds while the body streams in (a declared `content-length` over it is refused before
any byte is read), so a 30 GB body costs nothing (reliability §4.3); a client that trickles its
body is cut off at the deadline (§4.5). Decode errors name the failing path.
"""

from __future__ import annotations

import asyncio
from typing import TypeVar

import msgspec
from starlette.requests import Request

from gateway.errors import BadInput, MissingBody, Timeout, TooLarge

T = TypeVar("T")


async def read_body(request: Request, limit: int, timeout_s: float) -> bytes:
    """The body, refused with 413/3006 as soon as it passes `limit` (never read whole first), and
    408 when a slow client has not sent it within `timeout_s`."""
    declared = request.headers.get("content-length")
    # ASCII digits only (`isdigit` takes '²', which `int` refuses); too many for `int` are too large
    if (
        declared
        and declared.isascii()
        and declared.isdigit()
        and (len(declared) > 18 or int(declared) > limit)
    ):
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


# what a failing path most likely means, where a common mistake has one answer
_HINTS = {
    # Workers AI's JSON-mode page puts the schema itself there, as the older models take it (any
    # object: they never fail so); the OpenAI-compatible models (Kimi, GLM) take OpenAI's wrapper
    ("$.response_format.json_schema", "Object "): (
        ' (this model takes {"name": ..., "schema": <the JSON Schema>}, as OpenAI\'s API does)'
    ),
}


def decode(raw: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """Typed decode (`decode_json`); the 400 names the failing path (`$.messages[0].content`)."""
    try:
        return decode_json(raw, decoder)
    except msgspec.ValidationError as exc:
        message = str(exc)
        hint = next((h for (path, what), h in _HINTS.items() if message.endswith(f"- at `{path}`")
                     and message.startswith(what)), "")  # fmt: skip
        raise BadInput(f"Bad input: {message}{hint}") from exc
    except msgspec.DecodeError as exc:
        raise BadInput("Bad input: the body is not valid JSON") from exc
    except RecursionError as exc:
        raise BadInput("Bad input: the body is nested too deeply") from exc


def decode_json(raw: bytes, decoder: msgspec.json.Decoder[T]) -> T:
    """`decoder.decode(raw)`, except that a number with no fractional part (`1.0`, `2e3`) fills an
    integer field: JSON Schema's `integer` admits it, and Workers AI clients are JavaScript, where
    `1.0 === 1`. msgspec's integers are strict, so only a body that fails the typed decode is read
    again with its whole floats made integers (the usual path pays nothing); its errors stand."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError:
        value = msgspec.json.decode(raw)
        if not _has_whole_float(value):
            raise
        return decoder.decode(msgspec.json.encode(_whole_floats_as_ints(value)))


def _whole_floats_as_ints(value: object) -> object:
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, list):
        return [_whole_floats_as_ints(v) for v in value]
    if isinstance(value, dict):
        return {k: _whole_floats_as_ints(v) for k, v in value.items()}
    return value


def _has_whole_float(value: object) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    if isinstance(value, list):
        return any(_has_whole_float(v) for v in value)
    if isinstance(value, dict):
        return any(_has_whole_float(v) for v in value.values())
    return False

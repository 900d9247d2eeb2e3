"""The request body: read under a size limit and a deadline, then decoded with a typed decoder.

The limit holds while the body streams in (a declared `content-length` over it is refused before
any byte is read), so a 30 GB body costs nothing (reliability §4.3); a client that trickles its
body is cut off at the deadline (§4.5). Decode errors name the failing path.
"""

from __future__ import annotations

import asyncio
import re
from typing import TypeVar

import msgspec
from starlette.requests import ClientDisconnect, Request

from gateway.errors import BadInput, ClientClosed, MissingBody, Timeout, TooLarge

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
    except ClientDisconnect as exc:  # gone mid-body: nobody reads the answer (it was a 500 logged as a bug)
        raise ClientClosed("Client closed the request") from exc
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
    integer field: JSON Schema's `integer` admits it, and Python clients compute floats. msgspec's
    integers are strict, so only a body of at most `MAX_REREAD_BYTES` that fails the typed decode at
    such a number is read again: its top-level whole floats made integers at once, then the failing
    path alone, up to `MAX_WHOLE_FLOATS` times (the usual path pays nothing); any other error stands.
    A walk over the whole body in Python, for every bad request, let one client's 10 MB bodies hold
    the event loop 1.4 s each, and a re-read a field of a 10 MB body 0.5-1.2 s (red-team helpers)."""
    try:
        return decoder.decode(raw)
    except msgspec.ValidationError as exc:
        error = exc
    if len(raw) > MAX_REREAD_BYTES:
        raise error
    value: object = None
    for _ in range(MAX_WHOLE_FLOATS):
        found = _INT_GOT_FLOAT.match(str(error))
        if found is None:
            break
        is_changed = False
        if value is None:
            value = msgspec.json.decode(raw)
            if isinstance(value, dict):  # max_tokens, n, seed, top_k, …: one retry for all of them
                whole = [k for k, v in value.items() if isinstance(v, float) and v.is_integer()]
                value |= {k: int(value[k]) for k in whole}
                is_changed = bool(whole)
        if not (_make_int(value, found.group(1)) or is_changed):
            break
        try:
            return decoder.decode(msgspec.json.encode(value))
        except msgspec.ValidationError as exc:
            error = exc
    raise error


MAX_REREAD_BYTES = 1 << 20  # a larger body with a whole float in an integer field: its 400 stands
MAX_WHOLE_FLOATS = 8  # nested integer fields given as whole floats, fixed one at a time
_INT_GOT_FLOAT = re.compile(r"Expected `[^`]*\bint\b[^`]*`, got `float` - at `(\$[^`]*)`")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def _make_int(value: object, path: str) -> bool:
    """Make the whole float at `path` (msgspec's `$.a[0].b`) an integer, and the list's other whole
    floats where it is in one; False where there is none (a fraction, or a path through a dict's
    values, which msgspec writes `[...]`)."""
    steps = [(m.group(1), m.group(2)) for m in _STEP.finditer(path, 1)]
    if "".join(f".{k}" if k is not None else f"[{i}]" for k, i in steps) != path[1:]:
        return False
    parent, key = None, None
    node = value
    for name, index in steps:
        parent, key = node, (name if name is not None else int(index))
        is_field = isinstance(parent, dict) and isinstance(key, str) and key in parent
        if not (is_field or isinstance(parent, list) and isinstance(key, int) and key < len(parent)):
            return False
        node = parent[key]  # type: ignore[index]
    if parent is None or not isinstance(node, float) or not node.is_integer():
        return False
    if isinstance(parent, list):  # a list of integers written as floats: all of it at once
        parent[:] = [int(v) if isinstance(v, float) and v.is_integer() else v for v in parent]
    else:
        parent[key] = int(node)  # type: ignore[index]
    return True

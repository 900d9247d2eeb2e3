"""Typed decoding of request bodies: whole floats fill integer fields; a bad body costs one decode."""

from __future__ import annotations

import re
from typing import Any

import msgspec
import pytest
from starlette import requests

from gateway import body
from gateway.body import MAX_REREAD_BYTES, MAX_WHOLE_FLOATS, decode_json, read_body
from gateway.errors import ClientClosed


class Item(msgspec.Struct, forbid_unknown_fields=True):
    count: int
    ids: list[int] = []
    scale: float = 1.0


class Request(msgspec.Struct, forbid_unknown_fields=True):
    max_tokens: int | None = None
    items: list[Item] = []
    names: dict[str, int] = {}


DECODER = msgspec.json.Decoder(Request)


def test_whole_floats_fill_integer_fields_wherever_they_are() -> None:
    raw = b'{"max_tokens": 16.0, "items": [{"count": 1, "ids": [1, 2.0, 3e0], "scale": 2.0}, {"count": 4.0}]}'
    got = decode_json(raw, DECODER)
    assert got.max_tokens == 16 and [(i.count, i.ids, i.scale) for i in got.items] == [
        (1, [1, 2, 3], 2.0),
        (4, [], 1.0),
    ]
    assert decode_json(b'{"items": [{"count": 1, "ids": [' + b"1.0, " * 5000 + b"2]}]}", DECODER).items[
        0
    ].ids == [1] * 5000 + [2]


@pytest.mark.parametrize(
    ("raw", "where"),
    [
        (b'{"max_tokens": 16.5}', "$.max_tokens"),
        (b'{"items": [{"count": 1, "ids": [1, 2.5]}]}', "$.items[0].ids[1]"),
        (b'{"names": {"a": 1.0}}', "$.names[...]"),  # a dict's values have no path to follow
    ],
)
def test_a_fraction_or_an_unfollowable_path_is_refused_naming_it(raw: bytes, where: str) -> None:
    with pytest.raises(msgspec.ValidationError, match=re.escape(f"got `float` - at `{where}`")):
        decode_json(raw, DECODER)


def test_other_errors_stand_without_reading_the_body_again(monkeypatch: pytest.MonkeyPatch) -> None:
    """A body refused for anything but a whole float (an unknown field, say) costs its one typed
    decode: a walk over it in Python let one client's 10 MB bodies hold the event loop 1.4 s each;
    and a body over `MAX_REREAD_BYTES` is never read again (a re-read a field cost 0.5-1.2 s)."""
    untyped: list[int] = []
    decode = msgspec.json.decode

    def spy(raw: Any, **kw: Any) -> Any:
        if not kw:
            untyped.append(1)
        return decode(raw, **kw)

    monkeypatch.setattr(body.msgspec.json, "decode", spy)
    floats = b", ".join([b'{"a": 0.5}'] * 10_000)
    with pytest.raises(msgspec.ValidationError, match="unknown field `x`"):
        decode_json(b'{"max_tokens": 2, "x": [' + floats + b"]}", DECODER)
    with pytest.raises(msgspec.ValidationError, match="got `float`"):
        decode_json(
            b'{"max_tokens": 2.5, "items": [' + b", ".join([b'{"count": 1}'] * 10_000) + b"]}", DECODER
        )
    assert untyped == [1]  # the fraction's body was read once, to look at the one path
    big = b'{"max_tokens": 2.0, "items": [' + b", ".join([b'{"count": 1}'] * (MAX_REREAD_BYTES // 12)) + b"]}"
    with pytest.raises(msgspec.ValidationError, match=re.escape("got `float` - at `$.max_tokens`")):
        decode_json(big, DECODER)
    assert untyped == [1]
    top = b'{"max_tokens": 2.0, "items": [{"count": 3.0}]}'  # top-level fields: one retry for all
    assert decode_json(top, DECODER).max_tokens == 2 and untyped == [1, 1]
    nested = ", ".join(f'{{"count": {i}.0}}' for i in range(MAX_WHOLE_FLOATS + 1))
    assert len(decode_json(f'{{"items": [{nested[: nested.rindex(", ")]}]}}'.encode(), DECODER).items) == 8
    with pytest.raises(msgspec.ValidationError, match="got `float`"):  # one decode a field: bounded
        decode_json(f'{{"items": [{nested}]}}'.encode(), DECODER)


async def test_a_client_gone_mid_body_is_a_499_not_a_bug() -> None:
    """A client that closes while its body streams in gets ClientClosed (499 in the access log,
    nobody reads it); it was an unhandled `ClientDisconnect`, a 500 logged as a bug."""
    messages = [
        {"type": "http.request", "body": b'{"prompt": ', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict[str, object]:
        return messages.pop(0)

    request = requests.Request({"type": "http", "method": "POST", "headers": []}, receive)  # type: ignore[arg-type]
    with pytest.raises(ClientClosed):
        await read_body(request, 1 << 20, 5.0)
    assert ClientClosed.status == 499

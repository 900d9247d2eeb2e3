"""`FormData`, `Blob` and `File` as `workers` has them, and the parsing of form bodies into them.

`Request.form_data()` understands `multipart/form-data` (file uploads from a browser or
`curl -F`) and `application/x-www-form-urlencoded`. Text fields come back as `str`, uploaded files
as `File` (`name`, `content_type`, `size`, `await bytes()`, `await text()`).
"""

from __future__ import annotations

import email.message
from collections.abc import Iterator, MutableMapping
from urllib.parse import parse_qsl


class Blob:
    """Immutable bytes with a content type."""

    def __init__(self, data: bytes, content_type: str = "") -> None:
        self._data = bytes(data)
        self.content_type = content_type

    @property
    def size(self) -> int:
        return len(self._data)

    async def bytes(self) -> bytes:
        return self._data

    async def text(self) -> str:
        return self._data.decode("utf-8")


class File(Blob):
    """An uploaded file: a `Blob` with the file name the client gave."""

    def __init__(self, data: bytes, filename: str, content_type: str = "") -> None:
        super().__init__(data, content_type)
        self.name = filename


class FormData(MutableMapping[str, "str | Blob"]):
    """Form fields by name; `form[name]` is the first value, `get_all(name)` every value."""

    def __init__(self, items: list[tuple[str, str | Blob]] | None = None) -> None:
        self._items: list[tuple[str, str | Blob]] = list(items or [])

    def __getitem__(self, key: str) -> str | Blob:
        for name, value in self._items:
            if name == key:
                return value
        raise KeyError(key)

    def __setitem__(self, key: str, value: str | Blob) -> None:
        del self[key]
        self._items.append((key, value))

    def __delitem__(self, key: str) -> None:
        self._items = [(name, value) for name, value in self._items if name != key]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(name for name, _ in self._items))

    def __len__(self) -> int:
        return len(dict.fromkeys(name for name, _ in self._items))

    def append(self, key: str, value: str | Blob) -> None:
        self._items.append((key, value))

    def get_all(self, key: str) -> list[str | Blob]:
        return [value for name, value in self._items if name == key]


def _header_params(content_type: str) -> email.message.Message:
    message = email.message.Message()
    message["content-type"] = content_type
    return message


def parse_form(body: bytes, content_type: str) -> FormData:
    """The fields of a form body; a body of another type is a `TypeError`, as in the runtime."""
    header = _header_params(content_type)
    kind = header.get_content_type()
    if kind == "application/x-www-form-urlencoded":
        return FormData(list(parse_qsl(body.decode("utf-8"), keep_blank_values=True)))
    boundary = header.get_param("boundary")
    if kind != "multipart/form-data" or not isinstance(boundary, str):
        raise TypeError(f"Unrecognized Content-Type header value: {content_type!r} is not a form")
    return FormData(list(_multipart_items(body, boundary.encode("latin-1"))))


def _multipart_items(body: bytes, boundary: bytes) -> Iterator[tuple[str, str | Blob]]:
    # parts are separated by CRLF--boundary; the body's first boundary has no CRLF before it
    sections = (b"\r\n" + body).split(b"\r\n--" + boundary)
    for section in sections[1:]:
        if section.startswith(b"--"):  # the closing boundary
            return
        head, sep, content = section.partition(b"\r\n\r\n")
        if not sep:
            raise TypeError("malformed multipart body: a part has no blank line after its headers")
        part = email.message.Message()
        for line in head.decode("utf-8", "replace").split("\r\n"):
            name, colon, value = line.partition(":")
            if colon:
                part[name.strip()] = value.strip()
        field = part.get_param("name", header="content-disposition")
        if not isinstance(field, str):
            raise TypeError("malformed multipart body: a part has no name")
        filename = part.get_param("filename", header="content-disposition")
        if isinstance(filename, str):
            yield field, File(content, filename, part.get_content_type() if part["content-type"] else "")
        else:
            yield field, content.decode("utf-8")

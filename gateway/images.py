"""Image inputs: data: URIs, http(s) URLs fetched under limits, and the legacy `image` field.

The backend only ever receives checked bytes (DESIGN §2 step 2). A URL is fetched by resolving its
host once, refusing any address that is not global (loopback, private, link-local, the metadata
service, …) unless configured, and dialling the checked address itself (TLS still verifies the
host name), so a DNS answer cannot change between the check and the connection. Redirects are
followed by hand and each hop is checked again; size, time and hop count are capped; the bytes
must be an image Pillow can decode, of an allowed format and pixel count.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urljoin, urlsplit

import anyio
import httpx
from PIL import Image, UnidentifiedImageError

from gateway.errors import BadInput
from schemas.backend import ImagePart

FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}


class ImageRejected(BadInput):
    """An image the gateway will not pass on; the message says why (never the fetched content)."""


@dataclass(frozen=True)
class ImageLimits:
    max_bytes: int
    max_pixels: int
    timeout_s: float
    max_redirects: int
    allow_private: bool
    allowed_networks: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()  # exceptions to the rule


class ImageFetcher:
    """Turns every accepted image form into an `ImagePart` of checked bytes."""

    def __init__(self, http: httpx.AsyncClient, limits: ImageLimits) -> None:
        self._http = http  # follow_redirects must be off: hops are checked here
        self._limits = limits

    async def from_url(self, url: str) -> ImagePart:
        """An OpenAI `image_url.url`: a data: URI or an http(s) URL."""
        if url.startswith("data:"):
            return self.check(_decode_data_uri(url))
        return self.check(await self._fetch(url))

    def from_legacy(self, image: list[int] | str) -> ImagePart:
        """The legacy `image` field: an array of byte values, or a base64 string (or a data: URI)."""
        if isinstance(image, list):
            return self.check(bytes(image))
        if image.startswith("data:"):
            return self.check(_decode_data_uri(image))
        try:
            return self.check(base64.b64decode(image, validate=True))
        except (binascii.Error, ValueError) as exc:
            raise ImageRejected("Invalid data type for base64 input: image") from exc

    def check(self, data: bytes) -> ImagePart:
        """Size, decodability, format and pixel count; the media type comes from the bytes."""
        if len(data) > self._limits.max_bytes:
            raise ImageRejected(f"image is larger than {self._limits.max_bytes} bytes")
        try:
            # only the accepted formats' parsers: Pillow would otherwise try every one it has
            with Image.open(io.BytesIO(data), formats=list(FORMATS)) as img:
                fmt, (width, height) = img.format, img.size
                if width * height > self._limits.max_pixels:
                    raise ImageRejected(f"image has more than {self._limits.max_pixels} pixels")
                img.verify()
        except (
            UnidentifiedImageError,
            OSError,
            SyntaxError,
            ValueError,
            Image.DecompressionBombError,
        ) as exc:
            raise ImageRejected("image could not be decoded (png, jpeg, webp or gif)") from exc
        if fmt not in FORMATS:
            raise ImageRejected(f"image format {fmt} is not supported (png, jpeg, webp, gif)")
        return ImagePart(data=data, media_type=FORMATS[fmt])

    async def _fetch(self, url: str) -> bytes:
        try:
            with anyio.fail_after(self._limits.timeout_s):  # anyio's, as gateway/pools.py says why
                for _ in range(self._limits.max_redirects + 1):
                    target = await self._checked_target(url)
                    body, next_url = await self._get(url, target)
                    if body is not None:
                        return body
                    url = next_url
        except TimeoutError as exc:
            raise ImageRejected("image URL timed out") from exc
        except httpx.InvalidURL as exc:  # not an HTTPError: a character or length httpx refuses
            raise ImageRejected("image URL is malformed") from exc
        except httpx.HTTPError as exc:
            raise ImageRejected(f"image URL could not be fetched ({type(exc).__name__})") from exc
        raise ImageRejected("image URL redirected too many times")

    async def _checked_target(self, url: str) -> str:
        """The address to dial for `url`, after checking every address its host resolves to."""
        try:
            parts = urlsplit(url)
            port = parts.port or (443 if parts.scheme == "https" else 80)
        except ValueError as exc:  # a bad port or bracketed host
            raise ImageRejected("image URL is malformed") from exc
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ImageRejected("image URL must be a data: URI or an http(s) URL")
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(
                parts.hostname, port, type=socket.SOCK_STREAM
            )
        except (socket.gaierror, UnicodeError) as exc:  # UnicodeError: a label IDNA cannot encode
            raise ImageRejected("image URL host does not resolve") from exc
        addresses = [ipaddress.ip_address(info[4][0]) for info in infos]
        if not self._limits.allow_private:
            for address in addresses:
                if not _is_public(address) and not self._is_allowed(address):
                    raise ImageRejected("image URL points to a private, loopback or link-local address")
        return str(addresses[0])

    def _is_allowed(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(address in net for net in self._limits.allowed_networks)

    async def _get(self, url: str, address: str) -> tuple[bytes | None, str]:
        """GET `url` from `address`: the body (≤ cap), or None and the redirect target."""
        parts = urlsplit(url)
        host = f"[{address}]" if ":" in address else address
        dial = parts._replace(netloc=f"{host}:{parts.port or (443 if parts.scheme == 'https' else 80)}")
        # identity only: a compressed body would be inflated chunk by chunk before the size cap
        # could see it (a decompression bomb); an encoded answer is refused below, never decoded
        headers = {
            "host": parts.netloc.rsplit("@", 1)[-1],
            "accept": "image/*",
            "accept-encoding": "identity",
        }
        extensions = {"sni_hostname": parts.hostname} if parts.scheme == "https" else {}
        request = self._http.build_request("GET", dial.geturl(), headers=headers, extensions=extensions)
        response = await self._http.send(request, stream=True)
        try:
            if response.is_redirect:
                location = response.headers.get("location")
                if not location:
                    raise ImageRejected("image URL redirect has no location")
                return None, urljoin(url, location)
            if response.status_code != 200:
                raise ImageRejected(f"image URL answered HTTP {response.status_code}")
            content_type = response.headers.get("content-type", "").split(";")[0].strip().lower()
            if not content_type.startswith("image/"):
                raise ImageRejected(f"image URL has content type {content_type or 'none'}, not image/*")
            encoding = response.headers.get("content-encoding", "identity").strip().lower()
            if encoding not in ("", "identity"):
                raise ImageRejected(f"image URL answered with content encoding {encoding}")
            declared = response.headers.get("content-length", "")
            if (
                declared.isascii()
                and declared.isdigit()
                and (len(declared) > 18 or int(declared) > self._limits.max_bytes)
            ):
                raise ImageRejected(f"image is larger than {self._limits.max_bytes} bytes")
            body = bytearray()
            async for chunk in response.aiter_raw():
                body += chunk
                if len(body) > self._limits.max_bytes:
                    raise ImageRejected(f"image is larger than {self._limits.max_bytes} bytes")
            return bytes(body), url
        finally:
            await response.aclose()


# IPv6 prefixes that carry an IPv4 address in their low 32 bits (NAT64 well-known and local-use,
# IPv4-compatible): such an address reaches whatever its IPv4 address does
_EMBEDDING_V4 = tuple(ipaddress.IPv6Network(n) for n in ("64:ff9b::/96", "64:ff9b:1::/48", "::/96"))


def _is_public(address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Global unicast, and so is any IPv4 address it embeds (mapped, 6to4, NAT64, compatible)."""
    if not address.is_global or address.is_multicast:
        return False
    if isinstance(address, ipaddress.IPv6Address):
        embedded = [address.ipv4_mapped, address.sixtofour]
        if any(address in net for net in _EMBEDDING_V4):
            embedded.append(ipaddress.IPv4Address(int(address) & 0xFFFFFFFF))
        return all(v4 is None or _is_public(v4) for v4 in embedded)
    return True


def _decode_data_uri(uri: str) -> bytes:
    header, _, payload = uri.partition(",")
    if not header.endswith(";base64"):
        raise ImageRejected("image data: URI must be base64-encoded")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageRejected("Invalid data type for base64 input: image_url") from exc

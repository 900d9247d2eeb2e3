# ruff: noqa: F811  (pytest fixtures imported by name)
"""Image inputs: data: URIs, and URLs fetched under limits with no way to reach loopback, private,
link-local or metadata addresses (reliability §4.4), each redirect hop checked again."""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import gzip
import io
import ipaddress
from collections.abc import AsyncIterator

import httpx
import msgspec
import pytest
from fake_backend import Served, serve
from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)
from PIL import Image
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import RedirectResponse, Response
from starlette.routing import Route

from gateway.catalog import load_catalog_file
from gateway.errors import BadInput, Unsupported
from gateway.images import ImageFetcher, ImageLimits, ImageRejected
from gateway.normalize import Context
from gateway.normalize_openai import from_openai
from gateway.settings import GatewaySettings, settings_from
from schemas.admin import Quotas, TenantCreate, TokenCreate
from schemas.backend import ImagePart
from schemas.catalog import ModelSpec
from schemas.openai import ChatCompletionRequest


def png_bytes(size: int = 8) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (size, size), "green").save(out, format="PNG")
    return out.getvalue()


class Site:
    """A local web server: an image, a page, a big image, redirects, a slow answer."""

    def __init__(self) -> None:
        self.hits: list[str] = []
        self.redirect_to = ""
        self.accept_encoding = ""

    def app(self) -> Starlette:
        async def handle(request: Request) -> Response:
            self.hits.append(request.url.path)
            path = request.url.path
            if path == "/img.png":
                return Response(png_bytes(), media_type="image/png")
            if path == "/page":
                return Response(b"<html></html>", media_type="text/html")
            if path == "/big.png":
                return Response(png_bytes(256), media_type="image/png")
            if path == "/redirect":
                return RedirectResponse(self.redirect_to, status_code=302)
            if path == "/loop":
                return RedirectResponse("/loop", status_code=302)
            if path == "/gzip.png":  # compressed whatever the client accepts
                self.accept_encoding = request.headers.get("accept-encoding", "")
                body = gzip.compress(png_bytes() + b"\0" * 1_000_000)
                return Response(body, media_type="image/png", headers={"content-encoding": "gzip"})
            if path == "/slow.png":
                await asyncio.sleep(2)
                return Response(png_bytes(), media_type="image/png")
            return Response(status_code=404)

        return Starlette(routes=[Route("/{path:path}", handle)])


@pytest.fixture(scope="module")
async def sites() -> AsyncIterator[tuple[Site, Served, Site, Served]]:
    public, private = Site(), Site()
    a = await serve(public.app(), host="127.0.0.1")
    b = await serve(private.app(), host="127.0.0.2")
    yield public, a, private, b
    await a.stop()
    await b.stop()


_CLIENTS: list[httpx.AsyncClient] = []  # the fetchers' clients, closed after each test


@pytest.fixture(autouse=True)
async def close_fetchers() -> AsyncIterator[None]:
    yield
    while _CLIENTS:
        await _CLIENTS.pop().aclose()


def fetcher(*, allowed: str | None = None, max_bytes: int = 4096, timeout_s: float = 1.0) -> ImageFetcher:
    nets = (ipaddress.ip_network(allowed),) if allowed else ()
    limits = ImageLimits(
        max_bytes=max_bytes,
        max_pixels=512 * 512,
        timeout_s=timeout_s,
        max_redirects=3,
        allow_private=False,
        allowed_networks=nets,
    )
    _CLIENTS.append(httpx.AsyncClient(follow_redirects=False, trust_env=False))
    return ImageFetcher(_CLIENTS[-1], limits)


async def test_data_uris_are_decoded_and_checked() -> None:
    f = fetcher()
    part = await f.from_url("data:image/png;base64," + base64.b64encode(png_bytes()).decode())
    assert part.data == png_bytes() and part.media_type == "image/png"
    with pytest.raises(ImageRejected, match="could not be decoded"):
        await f.from_url("data:image/png;base64," + base64.b64encode(b"not an image").decode())
    with pytest.raises(ImageRejected, match="larger than"):
        f.check(png_bytes(256) + b"\0" * 5000)
    with pytest.raises(ImageRejected, match="base64"):
        f.from_legacy("%%%not base64")


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:9/img.png",
        "http://localhost:9/img.png",
        "http://10.0.0.1/img.png",
        "http://192.168.1.1/img.png",
        "http://169.254.169.254/latest/meta-data/",
        "http://[::1]/img.png",
        "http://[fe80::1]/img.png",
        "http://0.0.0.0/img.png",
        "http://2130706433/img.png",  # 127.0.0.1 in decimal
        "http://0x7f.1/img.png",
        "http://017700000001/img.png",  # octal
        "http://[::ffff:127.0.0.1]/img.png",
        "http://[::ffff:169.254.169.254]/img.png",
        "http://[64:ff9b::7f00:1]/img.png",  # NAT64 of 127.0.0.1
        "http://[64:ff9b::a9fe:a9fe]/img.png",  # NAT64 of the metadata service
        "http://[::127.0.0.1]/img.png",  # IPv4-compatible
        "http://[2002:7f00:1::]/img.png",  # 6to4 of 127.0.0.1
        "http://[2001:0:4136:e378:8000:63bf:80ff:fffe]/img.png",  # Teredo, client 127.0.0.1
    ],
)
async def test_non_global_addresses_are_refused_before_connecting(url: str) -> None:
    with pytest.raises(ImageRejected, match="private, loopback or link-local"):
        await fetcher().from_url(url)


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com:99999/img.png",
        "http://" + "a" * 70 + ".example/img.png",
        "http://[::1/img.png",
        "ftp://example.com/img.png",
    ],
)
async def test_malformed_urls_are_a_bad_input_not_a_crash(url: str) -> None:
    with pytest.raises(ImageRejected, match="image URL"):
        await fetcher().from_url(url)


@pytest.mark.parametrize("path", ["a\x00b", "a" * 70_000])
async def test_urls_httpx_cannot_send_are_a_bad_input(path: str) -> None:
    with pytest.raises(ImageRejected, match="image URL is malformed"):
        await fetcher(allowed="127.0.0.1/32").from_url(f"http://127.0.0.1:9/{path}")


async def test_loopback_site_is_refused_by_default(sites: tuple[Site, Served, Site, Served]) -> None:
    public, a, _, _ = sites
    before = len(public.hits)
    with pytest.raises(ImageRejected):
        await fetcher().from_url(f"{a.url}/img.png")
    assert len(public.hits) == before  # never contacted


async def test_allowed_network_fetches_with_type_size_and_time_limits(
    sites: tuple[Site, Served, Site, Served],
) -> None:
    _, a, _, _ = sites
    f = fetcher(allowed="127.0.0.1/32")
    assert (await f.from_url(f"{a.url}/img.png")).data == png_bytes()
    with pytest.raises(ImageRejected, match="content type text/html"):
        await f.from_url(f"{a.url}/page")
    with pytest.raises(ImageRejected, match="larger than"):
        await fetcher(allowed="127.0.0.1/32", max_bytes=200).from_url(f"{a.url}/big.png")
    with pytest.raises(ImageRejected, match="timed out"):
        await fetcher(allowed="127.0.0.1/32", timeout_s=0.3).from_url(f"{a.url}/slow.png")
    with pytest.raises(ImageRejected, match="too many times"):
        await f.from_url(f"{a.url}/loop")
    with pytest.raises(ImageRejected, match="HTTP 404"):
        await f.from_url(f"{a.url}/missing.png")


async def test_compressed_bodies_are_neither_asked_for_nor_inflated(
    sites: tuple[Site, Served, Site, Served],
) -> None:
    """A gzip body is a decompression bomb in waiting (1 MB of zeros is 1 KB on the wire): the
    fetcher asks for `identity` and refuses an encoded answer without inflating it."""
    public, a, _, _ = sites
    with pytest.raises(ImageRejected, match="content encoding gzip"):
        await fetcher(allowed="127.0.0.1/32").from_url(f"{a.url}/gzip.png")
    assert public.accept_encoding == "identity"


async def test_every_redirect_hop_is_checked(sites: tuple[Site, Served, Site, Served]) -> None:
    public, a, private, b = sites
    f = fetcher(allowed="127.0.0.1/32")
    public.redirect_to = f"{a.url}/img.png"
    assert (await f.from_url(f"{a.url}/redirect")).data == png_bytes()
    public.redirect_to = f"{b.url}/img.png"  # 127.0.0.2: not allowed
    with pytest.raises(ImageRejected, match="private, loopback"):
        await f.from_url(f"{a.url}/redirect")
    assert private.hits == []
    public.redirect_to = "http://169.254.169.254/latest/meta-data/"
    with pytest.raises(ImageRejected, match="private, loopback"):
        await f.from_url(f"{a.url}/redirect")


async def test_gateway_refuses_a_loopback_image_url(
    harness: Harness, sites: tuple[Site, Served, Site, Served]
) -> None:
    public, a, _, _ = sites
    before = len(public.hits)
    content = [
        {"type": "text", "text": "what?"},
        {"type": "image_url", "image_url": {"url": f"{a.url}/img.png"}},
    ]
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}"),
        headers=harness.auth(),
        json={"messages": [{"role": "user", "content": content}]},
    )
    assert r.status_code == 400 and "private, loopback or link-local" in r.json()["errors"][0]["message"]
    assert len(public.hits) == before


async def test_no_fetch_for_a_tenant_over_its_limits(
    harness: Harness, sites: tuple[Site, Served, Site, Served]
) -> None:
    store = harness.services.store
    tenant = await store.create_tenant(TenantCreate(name="blocked", plan="paid"), actor="test")
    token = await store.create_token(tenant.id, TokenCreate(name="t"), actor="test")
    await store.set_quotas(tenant.id, Quotas(requests_per_minute=0), actor="test")
    public, a, _, _ = sites
    before = len(public.hits)
    content = [{"type": "image_url", "image_url": {"url": f"{a.url}/img.png"}}]
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}", account=tenant.id),
        headers=harness.auth(token.value),
        json={"messages": [{"role": "user", "content": content}]},
    )
    assert r.status_code == 429 and r.json()["errors"][0]["code"] == 3021
    assert len(public.hits) == before


class CountingFetcher:
    """Stands in for `ImageFetcher` in normalisation: counts the URLs it was asked to fetch."""

    def __init__(self) -> None:
        self.urls: list[str] = []

    async def from_url(self, url: str) -> ImagePart:
        self.urls.append(url)
        return ImagePart(data=png_bytes(), media_type="image/png")


def _image_body(num_images: int) -> ChatCompletionRequest:
    content = [{"type": "text", "text": "what?"}] + [
        {"type": "image_url", "image_url": {"url": f"https://images.example/{i}.png"}}
        for i in range(num_images)
    ]
    return msgspec.convert({"messages": [{"role": "user", "content": content}]}, ChatCompletionRequest)


def _model(name: str) -> ModelSpec:
    return next(m for m in load_catalog_file(None).models if m.name == name)


def _context(images: CountingFetcher, max_images: int = 2) -> Context:
    return Context(
        request_id="r",
        tenant_salt="s",
        images=images,
        max_images=max_images,
        max_choices=8,  # type: ignore[arg-type]
    )


async def test_no_image_is_fetched_for_a_model_without_vision() -> None:
    glm = _model(GLM)
    images = CountingFetcher()
    with pytest.raises(Unsupported, match="does not support image inputs"):
        await from_openai(_image_body(1), glm, _context(images), allow_prompt=True)
    assert images.urls == []


async def test_no_image_is_fetched_when_there_are_too_many() -> None:
    kimi = _model(KIMI)
    images = CountingFetcher()
    with pytest.raises(BadInput, match="at most 2 images"):
        await from_openai(_image_body(3), kimi, _context(images), allow_prompt=True)
    assert images.urls == []
    too_many_choices = msgspec.structs.replace(_image_body(1), n=9)
    with pytest.raises(BadInput, match="'n' must be at most 8"):
        await from_openai(too_many_choices, kimi, _context(images), allow_prompt=True)
    assert images.urls == []
    normalized = await from_openai(_image_body(2), kimi, _context(images), allow_prompt=True)
    assert len(images.urls) == 2 and len(normalized.requests) == 1


def test_only_the_allowed_formats_parsers_ever_see_the_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pillow tries every parser it has (PSD, TGA, EPS, …) on unknown bytes; an untrusted image
    must only ever reach the parsers of the formats we accept."""
    from PIL import BmpImagePlugin

    parsed: list[str] = []
    real_open = BmpImagePlugin.BmpImageFile._open

    def spy(self: BmpImagePlugin.BmpImageFile) -> None:
        parsed.append("BMP")
        real_open(self)

    monkeypatch.setattr(BmpImagePlugin.BmpImageFile, "_open", spy)
    out = io.BytesIO()
    Image.new("RGB", (8, 8), "green").save(out, format="BMP")
    with pytest.raises(ImageRejected, match="could not be decoded"):
        fetcher().check(out.getvalue())
    assert parsed == []


async def test_image_bytes_times_choices_are_capped() -> None:
    """Every choice's backend request carries all the images (base64 in JSON): a 2 KB request of
    8 choices over 8 fetched 10 MB images made ~0.9 GB of bodies. The bytes times the choices are
    capped; under the cap the choices go out."""
    kimi = _model(KIMI)
    size = len(png_bytes())
    ctx = dataclasses.replace(_context(CountingFetcher()), max_image_bytes_total=4 * size)
    two_choices = msgspec.structs.replace(_image_body(2), n=2)
    assert len((await from_openai(two_choices, kimi, ctx, allow_prompt=True)).requests) == 2
    three_choices = msgspec.structs.replace(_image_body(2), n=3)
    with pytest.raises(BadInput, match=f"images total {2 * size} bytes, and each of the 3 choices"):
        await from_openai(three_choices, kimi, ctx, allow_prompt=True)
    s = GatewaySettings()  # one choice may carry as many images, as large, as before the cap
    assert s.max_image_bytes_total == s.max_images * s.max_image_bytes == 80 * 1024 * 1024
    env = {"KUMO_MAX_IMAGE_BYTES_TOTAL": "1000", "KUMO_SERVER_SECRET": "s" * 64}  # no data dir made
    assert settings_from(argparse.Namespace(), env).max_image_bytes_total == 1000


async def test_no_image_is_fetched_past_the_cap() -> None:
    """The cap stops the fetching: with n = 3 and room for 2 images' bytes times 3, the third image
    passes it and the fourth URL is never asked for (a request of 8 choices over 8 URLs of 10 MB fetched all 80 MB before its 400)."""
    size = len(png_bytes())
    images = CountingFetcher()
    ctx = dataclasses.replace(_context(images, max_images=4), max_image_bytes_total=6 * size)
    with pytest.raises(BadInput, match=f"images total {3 * size} bytes, and each of the 3 choices"):
        await from_openai(msgspec.structs.replace(_image_body(4), n=3), _model(KIMI), ctx, allow_prompt=True)
    assert len(images.urls) == 3

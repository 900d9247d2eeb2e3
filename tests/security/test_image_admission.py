"""Row 8 of issue 27: admission counted only `data:` images toward a request's token estimate, so
an image given by URL reserved nothing though a capped image costs 4,096 tokens. Every image part
now reserves a capped image's tokens before admission, whatever its form: a tenant whose tokens
per minute cannot hold them is refused before any URL is fetched.

And the security review after it: the estimate left out every JSON string starting with `data:`
(a pattern over the raw body), so a long prompt written as `data:…` was admitted at almost no
cost. Only the decoded body's inline images are left out now; text is text however it starts."""

from __future__ import annotations

import base64
import io
import re

import numpy as np
from gateway_harness import KIMI, Harness, _tenant
from PIL import Image

from gateway.inference import IMAGE_TOKENS_ESTIMATE
from schemas.admin import Quotas

TOKENS_PER_MINUTE = 6000  # room for one capped image, not two


def _png(size: int = 8) -> str:
    out = io.BytesIO()
    if size == 8:
        Image.new("RGB", (size, size), "green").save(out, format="PNG")
    else:  # noise: a PNG as large on the wire as its pixels
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def _body(url: str, num_images: int) -> dict:  # type: ignore[type-arg]
    parts = [{"type": "image_url", "image_url": {"url": url}} for _ in range(num_images)]
    return {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "describe"}]}],
            "max_tokens": 8}  # fmt: skip


async def test_url_images_reserve_their_capped_cost_before_admission(harness: Harness) -> None:
    assert IMAGE_TOKENS_ESTIMATE == 4225  # a capped image: 130 x 130 patches, merged 2x2
    account, token = await _tenant(harness.services, "image-admission", "paid")
    await harness.services.store.set_quotas(
        account, Quotas(tokens_per_minute=TOKENS_PER_MINUTE), actor="test"
    )
    url = harness.path(f"/ai/run/{KIMI}", account)
    estimates = {}
    # 127.0.0.1:9 would be refused by the address guard, but only after admission: a 429 here
    # shows the request never got that far
    for form, image in (("URL", "http://127.0.0.1:9/img.png"), ("data: URI", _png())):
        r = await harness.http.post(url, headers=harness.auth(token), json=_body(image, 2))
        print(
            f"tried 2 images by {form} at {TOKENS_PER_MINUTE} tokens/min: got {r.status_code} {r.text[:160]}"
        )
        assert r.status_code == 429, r.text
        error = r.json()["errors"][0]
        assert error["code"] == 3021 and "more than this account's 6000 tokens per minute" in error["message"]
        found = re.search(r"may use (\d+) tokens", error["message"])
        assert found is not None
        estimates[form] = int(found.group(1))
    assert (
        estimates["URL"] >= 2 * IMAGE_TOKENS_ESTIMATE and estimates["data: URI"] >= 2 * IMAGE_TOKENS_ESTIMATE
    )
    # one URL image fits: admitted, then refused by the address guard (a 400, not a fetch)
    r = await harness.http.post(url, headers=harness.auth(token), json=_body("http://127.0.0.1:9/img.png", 1))
    print(f"tried 1 image by URL: got {r.status_code} {r.text[:120]}")
    assert r.status_code == 400 and "private, loopback" in r.text


async def test_text_starting_with_data_counts_as_text_and_only_images_do_not(harness: Harness) -> None:
    account, token = await _tenant(harness.services, "data-prefix", "paid")
    await harness.services.store.set_quotas(
        account, Quotas(tokens_per_minute=TOKENS_PER_MINUTE), actor="test"
    )
    text = "word " * 8000  # 40 KB: ~10,000 tokens at admission's 4 bytes a token
    run, chat = harness.path(f"/ai/run/{KIMI}", account), harness.path("/ai/v1/chat/completions", account)
    for prefix in ("", "data:", "data:image/png;base64,"):
        bodies = {
            "legacy prompt": (
                harness.path("/ai/run/@cf/kumo/legacy-test", account),
                {"prompt": prefix + text},
            ),
            "message": (run, {"messages": [{"role": "user", "content": prefix + text}], "max_tokens": 8}),
            "text part": (
                chat,
                {
                    "model": KIMI,
                    "max_tokens": 8,
                    "messages": [{"role": "user", "content": [{"type": "text", "text": prefix + text}]}],
                },
            ),  # fmt: skip
        }
        for form, (url, body) in bodies.items():
            r = await harness.http.post(url, headers=harness.auth(token), json=body)
            print(
                f"tried 40 KB of text as a {form} starting with {prefix!r}: got {r.status_code} {r.text[:120]}"
            )
            assert r.status_code == 429, r.text
            error = r.json()["errors"][0]
            assert error["code"] == 3021
            found = re.search(r"may use (\d+) tokens", error["message"])
            assert found is not None and int(found.group(1)) >= len(text) // 4
    # a real image of as many bytes is an image: a capped image's tokens, not 10,000 of text
    image = _png(120)
    assert len(image) > 4 * TOKENS_PER_MINUTE
    r = await harness.http.post(run, headers=harness.auth(token), json=_body(image, 1))
    print(f"tried one {len(image)}-byte data: URI image: got {r.status_code} {r.text[:120]}")
    assert r.status_code == 200, r.text

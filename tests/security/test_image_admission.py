"""Row 8 of issue 27: admission counted only `data:` images toward a request's token estimate, so
an image given by URL reserved nothing though a capped image costs 4,096 tokens. Every image part
now reserves a capped image's tokens before admission, whatever its form: a tenant whose tokens
per minute cannot hold them is refused before any URL is fetched."""

from __future__ import annotations

import base64
import io
import re

from gateway_harness import KIMI, Harness, _tenant
from PIL import Image

from gateway.inference import IMAGE_TOKENS_ESTIMATE
from schemas.admin import Quotas

TOKENS_PER_MINUTE = 6000  # room for one capped image, not two


def _png() -> str:
    out = io.BytesIO()
    Image.new("RGB", (8, 8), "green").save(out, format="PNG")
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

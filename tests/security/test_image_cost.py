"""Row 2 of issue 27: one tenant could run the shared Kimi backend out of memory with small images.
A 65 KB PNG of 4096×4096 (at the pixel cap) is ~16,384 patches under full attention; 8 of them, each
choice of `n` preparing them again, and no bound on concurrent encodings: 55 s per request, 15 GB
for three. Now a request's images are bounded together (413 from their headers, before decoding),
the choices of one request share one encoding (and one replica), and the encoder takes a bounded
number of requests at once (429 past the waiting line)."""

from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pytest
import torch
from gateway_harness import KIMI, Harness
from PIL import Image

from backend.errors import Busy, TooManyImagePatches
from backend.models.image_encoder import ImageBudget, VisionEncoder
from backend.models.moonvit import MoonViT, VisionConfig
from gateway.backend_client import to_gateway_error
from schemas.backend import ImagePart

PAD = 7
VISION = {
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "patch_size": 14,
}


def _encoder(budget: ImageBudget) -> tuple[VisionEncoder, list[int]]:
    """A small MoonViT behind the serving encoder, and a list that grows by one per tower run."""
    torch.manual_seed(0)
    cfg = VisionConfig.from_config(
        {"vision_config": VISION, "projection_hidden_size": 32}, text_hidden_size=64
    )
    tower = MoonViT(cfg).eval()
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    runs: list[int] = []
    tower.register_forward_pre_hook(lambda module, args: runs.append(1))
    return VisionEncoder(tower, PAD, budget=budget), runs


def _png(width: int, height: int, seed: int = 0, *, noise: bool = True) -> bytes:
    out = io.BytesIO()
    if noise:
        rng = np.random.default_rng(seed)
        Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(out, format="PNG")
    else:
        Image.new("RGB", (width, height), "green").save(out, format="PNG")
    return out.getvalue()


def test_a_request_of_huge_images_is_refused_from_their_headers() -> None:
    encoder, runs = _encoder(ImageBudget())
    big = _png(4096, 4096, noise=False)  # at the gateway's pixel cap, a few KB on the wire
    images = [ImagePart(data=big)] * 8
    start = time.monotonic()
    with pytest.raises(TooManyImagePatches) as refused:
        encoder.expand([1, *([PAD] * 8), 2], images)
    took = time.monotonic() - start
    print(
        f"tried 8 PNGs of 4096x4096 ({len(big)} bytes each): got {type(refused.value).__name__} "
        f"{refused.value.status} in {took:.2f} s: {refused.value.message}"
    )
    assert (
        refused.value.status == 413
        and "135200 patches" in refused.value.message
        and "33800" in refused.value.message
    )
    assert runs == [] and took < 2.0  # nothing decoded, the tower never ran
    # two such images fit the default cap (16,900 patches each once padded, 4,225 tokens)
    ids, spans, embeds = encoder.expand([1, PAD, PAD, 2], images[:2])
    assert [s.length for s in spans] == [4225, 4225] and embeds.shape[0] == 8450 and runs == [1]


def test_the_choices_of_one_request_share_one_encoding() -> None:
    encoder, runs = _encoder(ImageBudget())
    images = [ImagePart(data=_png(300, 200, 1)), ImagePart(data=_png(120, 90, 2))]
    with ThreadPoolExecutor(8) as pool:  # n = 8 choices arriving together, as the gateway sends them
        results = list(pool.map(lambda _: encoder.expand([1, PAD, 3, PAD, 2], images), range(8)))
    print(f"tried 8 choices with the same 2 images at once: the tower ran {len(runs)} time(s)")
    assert len(runs) == 1
    first = results[0]
    assert all(r[0] == first[0] and r[1] == first[1] and torch.equal(r[2], first[2]) for r in results)
    encoder.expand([1, PAD, 3, PAD, 2], images)  # a choice arriving just after: shared too
    assert len(runs) == 1


def test_another_tenant_never_shares_an_encoding() -> None:
    """The same picture from two tenants (their salts) is encoded twice: a shared encoding skips the
    encoder, and the time to a first token would tell the second tenant that the first had just sent
    that picture. The choices of one tenant's request still share theirs."""
    encoder, runs = _encoder(ImageBudget())
    images = [ImagePart(data=_png(120, 90, 3))]
    a = encoder.expand([1, PAD, 2], images, "a" * 32)
    encoder.expand([1, PAD, 2], images, "a" * 32)
    assert len(runs) == 1
    b = encoder.expand([1, PAD, 2], images, "b" * 32)
    assert len(runs) == 2 and b[2] is not a[2] and torch.equal(b[2], a[2])


def test_the_encoder_takes_a_bounded_number_of_requests_and_429s_the_rest() -> None:
    encoder, runs = _encoder(ImageBudget(max_concurrent=1, max_waiting=1))
    entered, release = threading.Event(), threading.Event()

    def hold(module: object, args: object) -> None:
        entered.set()
        assert release.wait(20)

    encoder._tower.register_forward_pre_hook(hold)
    outcomes: list[str] = []

    def request(seed: int) -> None:
        try:
            encoder.expand([1, PAD, 2], [ImagePart(data=_png(64, 64, 10 + seed))])
            outcomes.append("ok")
        except Busy as exc:
            outcomes.append(f"{exc.status}")

    threads = [threading.Thread(target=request, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    assert entered.wait(20)
    for _ in range(200):  # the two past the line are refused at once, while the tower is held
        if outcomes.count("429") == 2:
            break
        time.sleep(0.01)
    refused_while_held = list(outcomes)
    release.set()
    for t in threads:
        t.join(20)
    print(
        f"tried 4 different image requests at once with 1 encoder and 1 waiting place: "
        f"while the first encoded got {refused_while_held}; in the end {sorted(outcomes)}"
    )
    assert refused_while_held == ["429", "429"] and sorted(outcomes) == ["429", "429", "ok", "ok"]
    assert len(runs) == 2
    encoder.expand([1, PAD, 2], [ImagePart(data=_png(64, 64, 99))])  # the line is free again


def test_the_gateway_answers_413_and_429_in_the_api_error_format() -> None:
    too_many = to_gateway_error(TooManyImagePatches("The request's 8 images make 135200 patches").to_event())
    busy = to_gateway_error(Busy("The image encoder is busy; try again shortly.").to_event())
    print(f"backend refusals became: {too_many.status}/{too_many.code} and {busy.status}/{busy.code}")
    assert (too_many.status, too_many.code) == (413, 3006) and "135200 patches" in too_many.message
    assert (busy.status, busy.code) == (429, 3040) and busy.retry_after == 1


async def test_the_choices_of_an_image_request_go_to_one_replica(harness: Harness) -> None:
    uri = "data:image/png;base64," + base64.b64encode(_png(32, 32, 5)).decode()
    content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": uri}}]
    kimi = harness.backends["kimi-k2.6"]
    for _ in range(3):
        before = [len(b.requests) for b in kimi]
        r = await harness.http.post(
            harness.path(f"/ai/run/{KIMI}"),
            headers=harness.auth(),
            json={"messages": [{"role": "user", "content": content}], "n": 4, "max_tokens": 8},
        )
        assert r.status_code == 200, r.text
        got = [len(b.requests) - n for b, n in zip(kimi, before, strict=True)]
        print(f"tried n=4 with an image over 2 replicas: choices per replica {got}")
        assert sorted(got) == [0, 4]


@pytest.mark.slow
def test_an_image_bomb_through_kumo_serve_is_a_413_at_once(kumo: Any) -> None:
    """The attack as reported, through the public API of the embedded `kumo serve` (gateway and a
    real Kimi backend on the CPU): 8 PNGs of 4096×4096 with n=8. Before: 55 s and gigabytes; now a
    413 with Workers AI code 3006, in seconds, and the backend still serves the next request."""
    import httpx

    uri = "data:image/png;base64," + base64.b64encode(_png(4096, 4096, noise=False)).decode()
    parts = [{"type": "image_url", "image_url": {"url": uri}} for _ in range(8)]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}], "n": 8,
            "max_tokens": 1}  # fmt: skip
    start = time.monotonic()
    r = httpx.post(kumo.path(f"/ai/run/{KIMI}"), headers=kumo.auth, json=body, timeout=120)
    took = time.monotonic() - start
    print(
        f"tried 8 PNGs of 4096x4096 with n=8 through kumo serve: got {r.status_code} in {took:.2f} s: {r.text[:200]}"
    )
    assert r.status_code == 413 and r.json()["errors"][0]["code"] == 3006, r.text
    assert "patches" in r.json()["errors"][0]["message"] and took < 10
    small = {"messages": [{"role": "user", "content": [parts[0] | {"image_url": {"url": "data:image/png;base64,"
             + base64.b64encode(_png(64, 48, 3)).decode()}}, {"type": "text", "text": "?"}]}], "n": 2, "max_tokens": 2}  # fmt: skip
    r = httpx.post(kumo.path(f"/ai/run/{KIMI}"), headers=kumo.auth, json=small, timeout=120)
    assert r.status_code == 200, r.text

"""Every architecture through the HTTP app on its tiny checkpoint (in-process: the session's one
backend process serves GLM-5 in test_server.py)."""

from __future__ import annotations

import base64
import io
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import msgspec
import numpy as np
import pytest
from PIL import Image

from backend.errors import InvalidRequest
from backend.server.app import build_backend, create_app
from backend.server.generation import Serving
from backend.server.model_card import ServedModel
from backend.server.settings import build_settings
from backend.text.tokenizer import load_tokenizer
from schemas.backend import (
    ErrorBody,
    Event,
    Finish,
    GenerateRequest,
    ImagePart,
    Message,
    ModelCard,
    Reasoning,
    ReasoningDelta,
    TextDelta,
    TextPart,
    Usage,
)
from tests.backend.server_checkpoints import SECRET, TENANT, make_served_checkpoint

AUTH = {"authorization": f"Bearer {SECRET}"}
_event = msgspec.json.Decoder(Event).decode
ARCHS = {
    "kimi_k2": "DeepseekV3ForCausalLM",
    "kimi_k25": "KimiK25ForConditionalGeneration",
    "glm4_moe": "Glm4MoeForCausalLM",
}


@pytest.fixture(scope="module", params=list(ARCHS))
async def arch_client(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[tuple[str, httpx.AsyncClient, Path]]:
    arch = request.param
    path = make_served_checkpoint(arch, tmp_path_factory.mktemp(arch))
    settings = build_settings(
        ["--model", str(path), "--port", "0", "--dtype", "float32", "--max-pages", "48", "--page-size", "8"],
        {"KUMO_BACKEND_SECRET": SECRET},
    )
    backend, engine = build_backend(settings)
    engine.start()
    try:
        transport = httpx.ASGITransport(app=create_app(backend))
        async with httpx.AsyncClient(transport=transport, base_url="http://backend", timeout=60) as client:
            yield arch, client, path
    finally:
        engine.stop()


async def _generate(client: httpx.AsyncClient, request_id: str, **extra: object) -> list[Event]:
    payload = {
        "request_id": request_id,
        "tenant_salt": TENANT,
        "messages": [{"role": "user", "content": "Tell me about Paris."}],
        "sampling": {"max_tokens": 10, "temperature": 0.0},
    } | extra
    response = await client.post("/v1/generate", json=payload, headers=AUTH)
    assert response.status_code == 200, response.text
    return [_event(line) for line in response.text.splitlines()]


async def test_card(arch_client: tuple[str, httpx.AsyncClient, Path]) -> None:
    arch, client, _ = arch_client
    card = msgspec.json.decode((await client.get("/v1/model", headers=AUTH)).content, type=ModelCard)
    assert card.architecture == ARCHS[arch]
    assert card.family == ("glm" if arch.startswith("glm") else "kimi")
    assert card.capabilities.tools and card.capabilities.reasoning


async def test_text_with_reasoning_off(arch_client: tuple[str, httpx.AsyncClient, Path]) -> None:
    _, client, _ = arch_client
    events = await _generate(client, "off", reasoning={"enabled": False})
    assert not any(isinstance(e, ReasoningDelta) for e in events)
    assert "".join(e.text for e in events if isinstance(e, TextDelta))
    assert isinstance(events[-2], Usage) and isinstance(events[-1], Finish)


async def test_reasoning_on_follows_the_template(arch_client: tuple[str, httpx.AsyncClient, Path]) -> None:
    """Kimi K2.5 opens `<think>` in the prompt (output is reasoning); GLM-4.5 leaves it to the model."""
    arch, client, _ = arch_client
    events = await _generate(client, "on", reasoning={"enabled": True})
    reasoning = "".join(e.text for e in events if isinstance(e, ReasoningDelta))
    assert bool(reasoning) == arch.startswith("kimi")


async def test_raw_prompt_and_missing_messages(arch_client: tuple[str, httpx.AsyncClient, Path]) -> None:
    _, client, path = arch_client
    raw = await client.post(
        "/v1/generate",
        headers=AUTH,
        json={
            "request_id": "raw",
            "tenant_salt": TENANT,
            "raw": True,
            "prompt": "Once upon a time",
            "sampling": {"max_tokens": 4, "temperature": 0.0},
        },
    )
    events = [_event(line) for line in raw.text.splitlines()]
    usage = next(e for e in events if isinstance(e, Usage))
    assert usage.prompt_tokens == len(
        load_tokenizer(path).encode("Once upon a time")
    )  # no template around it
    empty = await client.post(
        "/v1/generate", headers=AUTH, json={"request_id": "none", "tenant_salt": TENANT}
    )
    assert empty.status_code == 400
    assert msgspec.json.decode(empty.content, type=ErrorBody).error.code == "invalid_request"


async def test_template_free_checkpoint_needs_raw(tmp_path: Path) -> None:
    path = make_served_checkpoint("glm4_moe", tmp_path)
    (path / "chat_template.jinja").unlink()
    serving = Serving(ServedModel.from_checkpoint(path), engine=None)  # type: ignore[arg-type]
    request = GenerateRequest(
        request_id="x", tenant_salt=TENANT, messages=[Message(role="user", content="hi")]
    )
    with pytest.raises(InvalidRequest, match="no chat template"):
        serving.prepare(request)
    raw = GenerateRequest(request_id="y", tenant_salt=TENANT, raw=True, prompt="hi")
    assert serving.prepare(raw).engine_request.prompt_token_ids


def _png(width: int, height: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


async def test_images(arch_client: tuple[str, httpx.AsyncClient, Path]) -> None:
    """Kimi K2.5 sees images (each placeholder widened to its merged patches); the others refuse them."""
    arch, client, path = arch_client
    content = [
        {"type": "text", "text": "Compare"},
        {"type": "image", "data": base64.b64encode(_png(70, 56, 1)).decode()},
        {"type": "text", "text": "with"},
        {"type": "image", "data": base64.b64encode(_png(150, 97, 2)).decode()},
    ]
    payload = {
        "request_id": "img",
        "tenant_salt": TENANT,
        "messages": [{"role": "user", "content": content}],
        "sampling": {"max_tokens": 4, "temperature": 0.0},
        "reasoning": {"enabled": False},
    }
    response = await client.post("/v1/generate", json=payload, headers=AUTH)
    card = msgspec.json.decode((await client.get("/v1/model", headers=AUTH)).content, type=ModelCard)
    if arch != "kimi_k25":
        assert response.status_code == 400 and not card.capabilities.vision
        assert msgspec.json.decode(response.content, type=ErrorBody).error.code == "unsupported"
        return
    assert response.status_code == 200 and card.capabilities.vision
    events = [_event(line) for line in response.text.splitlines()]
    usage = next(e for e in events if isinstance(e, Usage))
    # grids 4×6 and 8×12 patches (padded to multiples of 28 px) → 6 and 24 merged tokens for 2 placeholders
    served = ServedModel.from_checkpoint(path)
    assert served.template is not None
    prompt = served.template.render(
        [
            Message(
                role="user",
                content=[
                    TextPart(text="Compare"),
                    ImagePart(data=b""),
                    TextPart(text="with"),
                    ImagePart(data=b""),
                ],
            )
        ],
        reasoning=Reasoning(enabled=False),
    )
    template_ids = len(served.tokenizer.encode(prompt))
    assert usage.prompt_tokens == template_ids - 2 + 6 + 24
    assert isinstance(events[-1], Finish)


def test_image_encodings_are_shared_within_one_tenant_only(tmp_path: Path) -> None:
    """Serving hands the image encoder the request's tenant salt as the scope of its shared
    encodings (the `n` choices of one request share one; another tenant's same picture must not hit
    it: the time to a first token would tell)."""
    from schemas.backend import ImagePart, TextPart

    scopes: list[str] = []

    class Spy:
        def expand(self, token_ids: list[int], images: list[ImagePart], scope: str = "") -> Any:
            scopes.append(scope)
            raise InvalidRequest("stop here")

    path = make_served_checkpoint("kimi_k25", tmp_path)
    serving = Serving(ServedModel.from_checkpoint(path), engine=None, images=Spy())  # type: ignore[arg-type]
    for salt in ("a" * 32, "b" * 32):
        content = [ImagePart(data=_png(28, 28, 1)), TextPart(text="what colour?")]
        request = GenerateRequest(
            request_id="x", tenant_salt=salt, messages=[Message(role="user", content=content)]
        )
        with pytest.raises(InvalidRequest, match="stop here"):
            serving.prepare(request)
    assert scopes == ["a" * 32, "b" * 32]

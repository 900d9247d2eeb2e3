"""Training sequences start with exactly the prompt serving sends, and the loss is on the turn only."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import msgspec
import pytest
import torch

from backend.models.image_encoder import MEDIA_PAD, VisionEncoder
from backend.server.generation import GenerationEngine, Serving
from backend.server.model_card import ServedModel
from backend.text.assistant_turn import after_opening
from backend.tools.random_checkpoint import write_random_checkpoint
from models.recipes.build import for_family, item
from models.recipes.images import render as draw
from models.recipes.render import Renderer
from models.recipes.world import make_world
from schemas.backend import GenerateRequest, Message, Reasoning, Tool

TASKS = ["tool-call", "gsm-nano", "arc-nano-easy", "mmlu-nano", "chat"]
WORLD = make_world(0)


@pytest.fixture(scope="module", params=["kimi-k2.6", "glm-5.2"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_random_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "ckpt")


def _serving(path: Path) -> Serving:
    model = ServedModel.from_checkpoint(path)
    vision = VisionEncoder.from_checkpoint(
        path, pad_token_id=model.tokenizer.token_to_id(MEDIA_PAD), dtype=torch.float32
    )
    return Serving(model, cast(GenerationEngine, None), images=vision)


def _request(it: dict[str, Any], messages: list[dict[str, Any]]) -> GenerateRequest:
    def part(p: dict[str, Any]) -> dict[str, Any]:
        return {"type": "image", "data": draw(it["image_spec"])} if p["type"] == "image" else p

    wire = [m | {"content": [part(p) for p in m["content"]]} if isinstance(m.get("content"), list) else m
            for m in messages]  # fmt: skip
    return GenerateRequest(
        request_id="r",
        tenant_salt="s",
        messages=msgspec.convert(wire, list[Message]),
        tools=[Tool(**t) for t in it["tools"]] if it.get("tools") else None,
        # a thinking-off training item is what a request with reasoning disabled sends
        reasoning=Reasoning(enabled=False) if it.get("enable_thinking") is False else Reasoning(),
    )


def _items(path: Path) -> list[dict[str, Any]]:
    kimi = (path / "tiktoken.model").exists()
    tasks = TASKS + (["image-qa"] if kimi else [])
    items = [for_family(item(t, seed, WORLD), "kimi" if kimi else "glm") for t in tasks for seed in (3, 8)]
    if not kimi:  # thinking-off items of the kinds the recipe writes them for (build.for_family)
        for t, seed in (("tool-call", 10), ("chat", 12)):
            on = for_family(item(t, seed, WORLD), "glm")
            plain = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in on["messages"]]
            items.append({**on, "messages": plain, "enable_thinking": False})
    return items


def test_each_turn_is_trained_on_the_prompt_serving_sends(checkpoint: Path) -> None:
    renderer, serving = Renderer(checkpoint), _serving(checkpoint)
    for it in _items(checkpoint):
        examples = renderer.examples(it)
        turns = [i for i, m in enumerate(it["messages"]) if m["role"] == "assistant"]
        assert sum(ex.loss_mask[k] and not ex.loss_mask[k - 1] for ex in examples
                   for k in range(1, len(ex.loss_mask))) == len(turns)  # fmt: skip
        for i in turns:
            sent = serving.prepare(_request(it, it["messages"][:i])).engine_request.prompt_token_ids
            ex = next(e for e in examples if e.token_ids[: len(sent)] == sent)
            # the prompt's own tokens (its generation prompt included) are not trained; the turn is
            assert not ex.loss_mask[len(sent) - 1] and ex.loss_mask[len(sent)], it["id"]


def test_loss_covers_reasoning_calls_and_the_stop_token(checkpoint: Path) -> None:
    renderer = Renderer(checkpoint)
    decode = renderer.tokenizer.decode
    it = item("gsm-nano", 5, WORLD)
    (ex,) = renderer.examples(it)
    target = decode([t for t, m in zip(ex.token_ids, ex.loss_mask, strict=True) if m])
    reasoning = it["messages"][1]["reasoning_content"]
    assert target.startswith(reasoning) and target.rstrip().endswith(tuple(["<|im_end|>", "<|endoftext|>"]))
    assert ex.token_ids[-1] in renderer.stop_ids
    calls = renderer.examples(item("tool-call", 5, WORLD))
    trained = "".join(decode([t for t, m in zip(e.token_ids, e.loss_mask, strict=True) if m]) for e in calls)
    name = item("tool-call", 5, WORLD)["expected"]["name"]
    assert name in trained and "Done:" in trained
    assert "Tools" not in trained and "tool_declare" not in trained  # the declarations are prompt, not loss


def test_an_image_item_carries_its_patches_and_one_pad_per_merged_patch(tmp_path: Path) -> None:
    path = write_random_checkpoint("kimi-k2.6", tmp_path / "k")
    renderer = Renderer(path)
    (ex,) = renderer.examples(item("image-qa", 3, WORLD))
    (image,) = ex.images
    assert (image.grid_h, image.grid_w) == (8, 8) and image.patches.shape == (64, 3, 14, 14)
    assert ex.token_ids.count(renderer.tokenizer.token_to_id(MEDIA_PAD)) == 16


def test_a_generation_prompt_that_does_not_open_the_turn_is_an_error() -> None:
    assert after_opening("<|assistant|>\n<think>r</think>", "<|assistant|><think>") == "r</think>"
    with pytest.raises(ValueError, match="does not open"):
        after_opening("<|assistant|>x<think>r</think>", "<|assistant|><think>")

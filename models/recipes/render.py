"""A training item (a chat transcript) → token ids, a loss mask and image inputs, laid out exactly as
serving lays out the prompt.

The prompt side is rendered by the checkpoint's own template and tokenizer through the code serving
uses (`backend.text.jinja_sandbox`, `backend.text.tokenizer`, `backend.models.image_processor`; none of them imports
msgspec, so this runs on the training machine). For every assistant turn:

    prompt  = the template with `add_generation_prompt` over the messages before the turn — the ids
              serving sends for that conversation, each image placeholder widened to one pad per
              merged patch as `backend.models.image_encoder` widens it;
    target  = the turn as the template renders it in history (reasoning, content, tool calls), minus
              the generation prompt's opening, up to and including the first stop token
              (`backend.text.assistant_turn`: `kumo eval` scores multiple-choice answers by the same rule).

The loss is on target tokens only. Turns whose prompt continues the previous
turn's prompt + target token for token share one sequence (Kimi); the others get their own (GLM).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from backend.models.image_processor import process_image
from backend.models.moonvit import VisionConfig
from backend.text.assistant_turn import assistant_turn_ids
from backend.text.jinja_sandbox import JinjaTemplate
from backend.text.tokenizer import Tokenizer, load_tokenizer
from models.recipes.images import render as draw

# turn-ending tokens of each family's chat format (as `backend.server.model_card.STOP_TOKENS`)
STOP_TOKENS = ("<|im_end|>", "[EOS]", "<|endoftext|>", "<|user|>", "<|observation|>")
MEDIA_PAD = "<|media_pad|>"


@dataclass(frozen=True, slots=True)
class ImageInput:
    patches: torch.Tensor  # [gh*gw, 3, P, P] float32, raster order (backend.models.image_processor)
    grid_h: int
    grid_w: int

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # pickled by value: a tensor crossing a process pool by torch's default (a file descriptor per
        # storage) ran out of descriptors at 150,000 Kimi items ("received 0 items of ancdata") and hung
        return _image_input, (self.patches.numpy(), self.grid_h, self.grid_w)


def _image_input(patches: Any, grid_h: int, grid_w: int) -> ImageInput:
    return ImageInput(torch.from_numpy(patches), grid_h, grid_w)


@dataclass(slots=True)
class Example:
    token_ids: list[int]
    loss_mask: list[bool]  # True where the model is trained to produce the token
    images: list[ImageInput] = field(default_factory=list)  # in placeholder order


class Renderer:
    """Renders training items for one checkpoint folder (tokenizer, template, vision config)."""

    def __init__(self, model_dir: str | Path) -> None:
        folder = Path(model_dir)
        template = JinjaTemplate.from_checkpoint(folder)
        if template is None:
            raise ValueError(f"{folder} ships no chat template")
        self.template = template
        self.tokenizer: Tokenizer = load_tokenizer(folder)
        self.stop_ids = {i for t in STOP_TOKENS if (i := self.tokenizer.token_to_id(t)) is not None}
        eos = self.tokenizer.named_id("eos_token")
        if eos is None:
            raise ValueError(f"{folder}: the tokenizer config names no eos_token")
        self.eos_id = eos
        raw = json.loads((folder / "config.json").read_text())
        self.vision = None
        self.pad_id = self.tokenizer.token_to_id(MEDIA_PAD)
        if "vision_config" in raw:
            text_hidden = (raw.get("text_config") or raw)["hidden_size"]
            self.vision = VisionConfig.from_config(raw, text_hidden_size=text_hidden)

    # serving's side ---------------------------------------------------------------------------------

    def prompt_ids(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        images: list[ImageInput],
        variables: dict[str, Any] | None = None,
    ) -> list[int]:
        """The ids serving sends for `messages` (generation prompt added, placeholders widened);
        `variables`: the template switches a request sets (`{"enable_thinking": False}`)."""
        text = self.template.render(messages, tools=tools, add_generation_prompt=True, variables=variables)
        return self.widen(self.tokenizer.encode(text), images)

    def widen(self, token_ids: list[int], images: list[ImageInput]) -> list[int]:
        """Each image placeholder widened to one pad per merged patch, images taken in order."""
        out: list[int] = []
        num_images = 0
        for t in token_ids:
            if t != self.pad_id or self.vision is None:
                out.append(t)
                continue
            image = images[num_images]
            out.extend([t] * (image.grid_h * image.grid_w // self.vision.tokens_per_merge))
            num_images += 1
        return out

    def images(self, item: dict[str, Any]) -> list[ImageInput]:
        """The item's pictures (drawn from `image_spec`), preprocessed as serving preprocesses them."""
        num_parts = sum(
            1
            for m in item["messages"]
            if isinstance(m.get("content"), list)
            for p in m["content"]
            if p.get("type") == "image"
        )
        if num_parts == 0:
            return []
        if self.vision is None:
            raise ValueError(f"item {item.get('id')} has images but the model has no vision tower")
        if num_parts != 1 or "image_spec" not in item:
            raise ValueError(f"item {item.get('id')}: one image part with an `image_spec` expected")
        v = self.vision
        p = process_image(draw(item["image_spec"]), patch=v.patch_size, merge=v.merge_kernel_size[0])
        return [ImageInput(p.patches, p.grid_h, p.grid_w)]

    # training's side --------------------------------------------------------------------------------

    def examples(self, item: dict[str, Any]) -> list[Example]:
        """The item's training sequences: every assistant turn trained once, on its serving prompt."""
        messages = [template_message(m) for m in item["messages"]]
        tools = template_tools(item.get("tools"))
        images = self.images(item)
        thinking_off = item.get("enable_thinking") is False
        if thinking_off:  # a thinking-off request has no reasoning to train on
            messages = [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages]
        variables = {"enable_thinking": False} if thinking_off else None
        out: list[Example] = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            prompt = self.prompt_ids(messages[:i], tools, images, variables)
            target = (
                self._target_no_thinking(messages, i, tools)
                if thinking_off
                else self._target(messages, i, tools)
            )
            last = out[-1] if out else None
            if last is not None and prompt[: len(last.token_ids)] == last.token_ids:
                extra = len(prompt) - len(last.token_ids)
                last.token_ids += prompt[len(last.token_ids) :] + target
                last.loss_mask += [False] * extra + [True] * len(target)
            else:
                out.append(Example(prompt + target, [False] * len(prompt) + [True] * len(target)))
        for ex in out:
            ex.images = self._images_of(ex.token_ids, images)
        return out

    def _images_of(self, token_ids: list[int], images: list[ImageInput]) -> list[ImageInput]:
        """The leading images whose widened placeholders are the pads in `token_ids`."""
        num_pads = sum(1 for t in token_ids if t == self.pad_id) if self.vision else 0
        taken, count = [], 0
        for image in images:
            if count == num_pads:
                break
            taken.append(image)
            count += len(self.widen([self.pad_id], [image]))
        if count != num_pads:
            raise ValueError(f"{num_pads} image pads do not match the images' {count} tokens")
        return taken

    def _target(
        self, messages: list[dict[str, Any]], i: int, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """The ids of assistant turn `i` after the generation prompt's opening, through its stop token
        (`backend.text.assistant_turn`, the rule `kumo eval` scores multiple-choice answers by)."""
        return assistant_turn_ids(
            self.template, self.tokenizer, messages, i, tools, stop_ids=self.stop_ids, eos_id=self.eos_id
        )

    def _target_no_thinking(
        self, messages: list[dict[str, Any]], i: int, tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Turn `i` of a thinking-off request (`enable_thinking: false`): the generation prompt ends in
        `</think>` (GLM-5's template; its history form writes an empty `<think></think>` there), so the
        model emits what the history form has after that empty block, through the stop token."""
        variables = {"enable_thinking": False}
        render = self.template.render
        history = render(messages[:i], tools=tools, add_generation_prompt=False, variables=variables)
        opening = render(messages[:i], tools=tools, add_generation_prompt=True, variables=variables)
        following = (
            messages[: i + 2]
            if i + 1 < len(messages) and messages[i + 1]["role"] != "user"
            else messages[: i + 1]
        )
        full = render(following, tools=tools, add_generation_prompt=False, variables=variables)
        if not full.startswith(history) or not opening.endswith("</think>"):
            raise ValueError("a thinking-off turn needs a template whose generation prompt ends in </think>")
        turn = full[len(history) :]
        if "<think></think>" not in turn:
            raise ValueError(f"the thinking-off turn {turn[:80]!r} has no empty <think></think> block")
        ids = self.tokenizer.encode(turn.split("<think></think>", 1)[1])
        stop = next((k for k, t in enumerate(ids) if t in self.stop_ids), None)
        return ids[: stop + 1] if stop is not None else ids + [self.eos_id]


def template_message(m: dict[str, Any]) -> dict[str, Any]:
    """An item's message in the shape serving hands the template (`backend.text.chat_template.message_dict`):
    tool-call arguments as a mapping, image parts as `{"type": "image"}`."""
    out = dict(m)
    if isinstance(m.get("content"), list):
        out["content"] = [
            {"type": "text", "text": p["text"]} if p["type"] == "text" else {"type": "image"}
            for p in m["content"]
        ]
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function",
             "function": {"name": c["function"]["name"], "arguments": _arguments(c["function"]["arguments"])}}
            for c in m["tool_calls"]
        ]  # fmt: skip
    return out


def template_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Item tools (`{name, description, parameters}`) as serving hands them to the template."""
    if not tools:
        return None
    return [
        {"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                          "parameters": t.get("parameters", {})}}
        for t in tools
    ]  # fmt: skip


def _arguments(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def corpus_text(template: JinjaTemplate, items: list[dict[str, Any]], special_tokens: list[str]) -> list[str]:
    """The text a tokenizer is trained on: each item rendered by the template, special tokens cut out
    (they are added whole after the BPE vocabulary)."""
    out = []
    for item in items:
        text = template.render(
            [template_message(m) for m in item["messages"]],
            tools=template_tools(item.get("tools")),
            add_generation_prompt=False,
        )
        for s in special_tokens:
            text = text.replace(s, "\n")
        out.append(text)
    return out

"""How `kumo eval` turns task items into token ids, and generated ids back into answers.

Chat mode (the default when the checkpoint ships a chat template) goes through serving itself: each
prompt is a `GenerateRequest` that `backend.server.generation.Serving.prepare` renders with the checkpoint's
template and generation prompt, tokenizes and, for image parts, runs through serving's image path
(`backend.models.image_encoder`: preprocessing, the MoonViT tower, placeholders widened); the output ids go
through that request's own output processor (reasoning split, the family's tool-call parser), so the
answer is the content a client would receive. A multiple-choice answer is scored on the ids of the
assistant turn that gives it (`backend.text.assistant_turn`, the rule the recipe trains on).

Raw mode is plain text: the question or prompt tokenized as is, a choice as " CHOICE" after it.
Every variant prepares its own request: the variants' vision towers may differ, and an output
processor holds state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch

from backend.engine.prompt_runner import Generated, Prompt
from backend.models.image_encoder import MEDIA_PAD, VisionEncoder
from backend.server.generation import GenerationEngine, Prepared, Serving
from backend.server.model_card import ServedModel
from backend.text.assistant_turn import assistant_turn_ids
from backend.text.chat_template import message_dict
from backend.text.jinja_sandbox import JinjaTemplate
from backend.tools.eval_tasks import GenItem, McItem, ToolItem, prompt_turns
from schemas.backend import (
    EngineOutput,
    GenerateRequest,
    Message,
    SamplingParams,
    TextDelta,
    Tool,
    ToolCallDelta,
)


@dataclass(slots=True)
class Answer:
    """What a client would receive: the content after the reasoning, and the parsed tool calls."""

    content: str
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(slots=True)
class Request:
    """One variant's input for an item: the prompt, and in chat mode serving's prepared request
    (whose output processor reads the answer)."""

    prompt: Prompt
    prepared: Prepared | None = None


@dataclass(slots=True)
class Choice:
    """One choice of a multiple-choice item: the ids scored after the prompt, and its byte length."""

    target_ids: list[int]
    num_bytes: int


class EvalPrompts:
    def __init__(
        self,
        paths: list[Path],
        *,
        is_chat: bool,
        max_new_tokens: int,
        dtype: torch.dtype,
        devices: list[str],
    ) -> None:
        """`paths`: the variants' checkpoint folders, the first one's tokenizer and template used for
        all; `devices`: each variant's (its images are encoded there)."""
        self.is_chat, self.max_new_tokens, self.num_variants = is_chat, max_new_tokens, len(paths)
        self.served = ServedModel.from_checkpoint(paths[0])
        self.tokenizer = self.served.tokenizer
        self.template = JinjaTemplate.from_checkpoint(paths[0])
        if is_chat and self.template is None:
            raise ValueError(f"{paths[0]} has no chat template: run with --raw")
        self.servings = (
            [self._serving(p, dtype, d) for p, d in zip(paths, devices, strict=True)] if is_chat else []
        )
        # chat: where serving stops a turn; raw: the checkpoint's generation_config eos
        self.stop_ids = frozenset(self.served.eos_token_ids if is_chat else self.served.config.eos_token_ids)
        eos = self.tokenizer.named_id("eos_token")
        self.eos_id = eos if eos is not None else self.served.eos_token_ids[0]

    @staticmethod
    def _serving(path: Path, dtype: torch.dtype, device: str) -> Serving:
        served = ServedModel.from_checkpoint(path)
        vision = VisionEncoder.from_checkpoint(
            path, pad_token_id=served.tokenizer.token_to_id(MEDIA_PAD), dtype=dtype, device=device
        )
        served.has_vision = vision is not None
        return Serving(served, cast(GenerationEngine, None), images=vision)  # prepare never runs the engine

    # ---- prompts ---------------------------------------------------------------------------------
    def prepare(self, messages: list[Message], tools: list[Tool] | None = None) -> list[Request]:
        """Per variant, the request serving would run for `messages` (the turns before the first
        assistant one), greedy."""
        request = GenerateRequest(
            request_id="eval",
            tenant_salt="0" * 16,
            messages=prompt_turns(messages),
            tools=tools or None,
            sampling=SamplingParams(max_tokens=self.max_new_tokens, temperature=0.0),
        )
        return [Request(prompt_of(p), p) for p in (s.prepare(request) for s in self.servings)]

    def raw(self, text: str) -> list[Request]:
        return [Request(Prompt(self.tokenizer.encode(text, allow_special=False)))] * self.num_variants

    def multiple_choice(self, item: McItem) -> tuple[list[Request], list[Choice]]:
        """The item's prompt per variant, and each choice's scored ids."""
        if not self.is_chat:
            continuations = [" " + c for c in item.choices]
            choices = [
                Choice(self.tokenizer.encode(c, allow_special=False), len(c.encode())) for c in continuations
            ]
            return self.raw(item.text), choices
        assert self.template is not None
        messages = prompt_turns(item.messages or [Message(role="user", content=item.text)])
        history = [message_dict(m) for m in messages]
        choices = []
        for i in range(len(item.choices)):
            turn = item.turn(i)
            ids = assistant_turn_ids(
                self.template,
                self.tokenizer,
                [*history, {"role": "assistant", "content": turn}],
                len(history),
                None,
                stop_ids=self.stop_ids,
                eos_id=self.eos_id,
            )
            choices.append(Choice(ids, len(turn.encode())))
        return self.prepare(messages), choices

    def generation(self, item: GenItem | ToolItem) -> list[Request]:
        if isinstance(item, ToolItem):
            if not self.is_chat:
                raise ValueError("tool-call tasks need chat mode (a checkpoint with a chat template)")
            return self.prepare(item.messages, item.tools)
        if self.is_chat:
            return self.prepare(item.messages or [Message(role="user", content=item.prompt or "")])
        if item.prompt is None:
            raise ValueError("an item with `messages` and no `prompt` needs chat mode")
        return self.raw(item.prompt)

    # ---- answers ---------------------------------------------------------------------------------
    def read(self, request: Request, out: Generated) -> Answer:
        """The answer in `out`: through the request's output processor (chat), or decoded (raw)."""
        prepared = request.prepared
        if prepared is None:
            return Answer(self.tokenizer.decode(out.token_ids))
        ids = out.token_ids + ([out.stop_id] if out.stop_id is not None else [])
        engine_output = EngineOutput(
            request_id="eval",
            token_ids=ids,
            finish_reason="stop" if out.stop_id is not None else "length",
            num_prompt_tokens=len(prepared.engine_request.prompt_token_ids),
            num_output_tokens=len(ids),
        )
        events = prepared.processor.process(engine_output)
        calls: dict[int, ToolCallDelta] = {}
        for e in events:
            if isinstance(e, ToolCallDelta):
                first = calls.setdefault(e.index, ToolCallDelta(index=e.index, id=e.id, name=e.name))
                first.arguments += e.arguments
        return Answer("".join(e.text for e in events if isinstance(e, TextDelta)), list(calls.values()))


def prompt_of(prepared: Prepared) -> Prompt:
    """The runner's input for a prepared request: its ids, and its image rows at the placeholders."""
    request = prepared.engine_request
    positions = [s.offset + k for s in request.image_spans for k in range(s.length)]
    return Prompt(list(request.prompt_token_ids), positions, prepared.image_embeds)

"""The serving layer: a `GenerateRequest` in, internal-protocol events out (DESIGN.md §2 steps 4 and 7).

`prepare` does everything that can refuse a request before the engine sees it — template, tokens,
context window, images, grammar — so refusals are plain 4xx answers. `events` then runs the
request in the engine and turns its outputs into events. Leaving `events` early (client gone, stop
string matched) closes the engine stream, which aborts the request there within one step.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator
from contextlib import aclosing
from dataclasses import dataclass
from typing import Protocol

import torch
from llguidance import LLTokenizer

from backend.engine.constraint import TokenConstraint
from backend.errors import ContextWindowExceeded, InvalidRequest, Unsupported
from backend.server.model_card import ServedModel
from backend.text.chat_template import images_of
from backend.text.output_processor import OutputProcessor
from backend.text.reasoning import ReasoningParser
from backend.text.structured import (
    LazyToolConstraint,
    build_constraint,
    grammar_for,
    lazy_tool_grammar_for,
    unoffered_markers,
)
from backend.text.tool_parsers import MARKERS as TOOL_MARKERS_OF
from backend.text.tool_parsers import parser_for
from schemas.backend import (
    EngineOutput,
    EngineRequest,
    Event,
    GenerateRequest,
    ImagePart,
    ImageSpan,
    LoadReport,
    Message,
    Reasoning,
    ReasoningMarkers,
    Started,
    TextDelta,
    TextPart,
)

# a text this short over the window is tokenized before it is refused (a millisecond or so): the
# refusal names its real count, as one just over by its tokens does, not the characters' lower bound
EXACT_REFUSAL_CHARS = 65_536


class GenerationEngine(Protocol):
    """What serving needs of the engine (`backend.engine.async_engine.AsyncEngine`)."""

    def generate(
        self,
        request: EngineRequest,
        *,
        constraint: TokenConstraint | None = None,
        image_embeds: torch.Tensor | None = None,
    ) -> AsyncGenerator[EngineOutput, None]: ...

    def abort(self, request_id: str) -> None: ...

    def load(self) -> LoadReport: ...


class ImageEncoder(Protocol):
    """The vision hook: expands each image's placeholder in the prompt to its tokens and returns the
    placeholder spans (with image hashes, for the prefix-cache key) and their embeddings."""

    def expand(
        self, token_ids: list[int], images: list[ImagePart], scope: str = ""
    ) -> tuple[list[int], list[ImageSpan], torch.Tensor]: ...


@dataclass(slots=True)
class Prepared:
    engine_request: EngineRequest
    constraint: TokenConstraint | None
    image_embeds: torch.Tensor | None
    processor: OutputProcessor


class Serving:
    def __init__(
        self,
        model: ServedModel,
        engine: GenerationEngine,
        *,
        images: ImageEncoder | None = None,
        max_request_tokens: int | None = None,
    ) -> None:
        self.model = model
        self.engine = engine
        self._images = images
        # the replica's window: the model's, or its page pool's where smaller (the card's, which the
        # catalog advertises and the scheduler enforces): a refusal names that one
        self.max_request_tokens = min(model.context_window, max_request_tokens or model.context_window)
        # the most characters one token stands for: an ordinary token's bytes (a pass over the
        # vocabulary: now, once), or in a raw prompt, where specials are read, a special's spelling
        tokenizer = model.tokenizer
        self._max_token_chars = tokenizer.max_token_bytes
        self._max_raw_token_chars = max([self._max_token_chars, *map(len, tokenizer.special_spellings)])

    def prepare(self, request: GenerateRequest) -> Prepared:
        """Everything up to the engine; raises the `EngineError` refusing the request."""
        model = self.model
        grammar = grammar_for(request, model.family, model.marker_ids)
        # a constrained answer starts at the first token: the template must not open a reasoning block
        reasoning = Reasoning(enabled=False) if grammar is not None else request.reasoning
        # a text over the window by its length alone is refused untokenized (a 9 MB prompt took 7-32
        # s to refuse after tokenizing); a short one is counted, so its refusal names its tokens
        per_token = self._max_raw_token_chars if request.raw else self._max_token_chars
        num_chars = _text_chars(request)
        at_least = -(-num_chars // per_token) + request.sampling.max_tokens
        if at_least > self.max_request_tokens and num_chars > EXACT_REFUSAL_CHARS:
            raise ContextWindowExceeded(at_least, self.max_request_tokens)
        token_ids, images = self._prompt(request, reasoning)
        spans: list[ImageSpan] = []
        embeds = None
        if images:
            if self._images is None:
                raise Unsupported(f"{model.name} does not accept images.")
            # encodings shared by one tenant's requests alone (the `n` choices of one): never a hit
            # another tenant could time
            token_ids, spans, embeds = self._images.expand(token_ids, images, request.tenant_salt)
        num_requested = len(token_ids) + request.sampling.max_tokens
        if num_requested > self.max_request_tokens:
            raise ContextWindowExceeded(num_requested, self.max_request_tokens)
        constraint: TokenConstraint | None = None
        lazy = None if grammar is not None else lazy_tool_grammar_for(
            request, model.family, model.marker_ids, TOOL_MARKERS_OF[model.family]
        )  # fmt: skip
        if grammar is not None:
            what = "response format" if not request.tools else "response format or tool parameters"
            constraint = build_constraint(grammar, self._ll_tokenizer(), what)
        elif lazy is not None:
            tool_grammar, trigger_id, banned_ids = lazy
            matcher = build_constraint(tool_grammar, self._ll_tokenizer(), "tool parameters")
            constraint = LazyToolConstraint(matcher, trigger_id, banned_ids)
        engine_request = EngineRequest(
            request_id=request.request_id,
            prompt_token_ids=token_ids,
            tenant_salt=request.tenant_salt,
            sampling=request.sampling,
            image_spans=spans,
            eos_token_ids=model.eos_token_ids,
            reasoning_markers=self._reasoning_markers(request, token_ids, grammar is None),
            banned_token_ids=(
                unoffered_markers(request, model.marker_ids, TOOL_MARKERS_OF[model.family])
                if grammar is None
                else []
            ),
            reject_if_busy=request.reject_if_busy,
            priority=request.priority,
        )
        return Prepared(
            engine_request, constraint, embeds, self._processor(request, token_ids, grammar is None)
        )

    async def events(self, prepared: Prepared) -> AsyncGenerator[Event, None]:
        """Events of a prepared request. Raises the engine's refusal (busy, too large) before any event.
        The first engine output always makes an event (an empty text where the processor holds its
        tokens back: a tool call, hidden reasoning, a possible stop string), after `Started` (the
        prompt's token count): it says the prompt is in, which the gateway waits for before it routes
        a request's other choices, so that they start from its cached prompt pages."""
        stream = self.engine.generate(
            prepared.engine_request, constraint=prepared.constraint, image_embeds=prepared.image_embeds
        )
        is_first = True
        async with aclosing(stream):
            async for out in stream:
                events = prepared.processor.process(out)
                if is_first:  # the prompt's count first (what a cut choice is billed), then the output
                    started = Started(
                        prompt_tokens=out.num_prompt_tokens, cached_tokens=out.num_cached_tokens
                    )
                    events = [started, *(events or [TextDelta(text="")])]
                is_first = False
                for event in events:
                    yield event
                if prepared.processor.is_stopped or out.finish_reason is not None:
                    return

    def _ll_tokenizer(self) -> LLTokenizer:
        model = self.model
        return model.tokenizer.ll_tokenizer(
            max(model.config.vocab_size, model.tokenizer.vocab_size), model.eos_token_ids
        )

    def _prompt(self, request: GenerateRequest, reasoning: Reasoning) -> tuple[list[int], list[ImagePart]]:
        tokenizer = self.model.tokenizer
        if request.raw:
            if request.prompt is None or request.messages is not None:
                raise InvalidRequest("A raw request carries `prompt` and no `messages`.")
            return tokenizer.encode(request.prompt), []
        messages = request.messages
        if messages is None:
            if request.prompt is None:
                raise InvalidRequest("The request needs `messages` or `prompt`.")
            messages = [Message(role="user", content=request.prompt)]
        if self.model.template is None:
            raise InvalidRequest(f"{self.model.name} ships no chat template; send a raw prompt.")
        token_ids = self.model.template.encode(
            tokenizer, messages, tools=request.tools, reasoning=reasoning, extra=request.chat_template_kwargs
        )
        return token_ids, images_of(messages)

    def _reasoning_markers(
        self, request: GenerateRequest, prompt_ids: list[int], is_free: bool
    ) -> ReasoningMarkers | None:
        """The engine's reasoning guard for a request that reasons (issue 26: nano GLM ended 9 to 12
        of 60 everyday turns inside `<think>`, an empty answer; lab/results/2026-12-05-think-guard);
        open from the start where the prompt opened the block, as the reasoning parser reads it."""
        think = self.model.think
        if think is None or not _reasons(request, is_free):
            return None
        return ReasoningMarkers(
            start_id=think.start_id,
            end_id=think.end_id,
            is_open=think.is_open_after(prompt_ids),
            call_start_id=self._call_start_id(request),
        )

    def _call_start_id(self, request: GenerateRequest) -> int | None:
        """The family's tool-call opening marker when tools are offered (and not refused): it ends an
        open reasoning block (backend/text/reasoning.py)."""
        if not request.tools or (request.tool_choice is not None and request.tool_choice.mode == "none"):
            return None
        ids = [self.model.marker_ids.get(m) for m in TOOL_MARKERS_OF[self.model.family]]
        return None if None in ids else ids[0]  # a tokenizer without every marker parses no calls

    def _processor(self, request: GenerateRequest, prompt_ids: list[int], is_free: bool) -> OutputProcessor:
        model = self.model
        reasoning = None
        if model.think is not None:
            enabled = _reasons(request, is_free)
            reasoning = ReasoningParser(
                model.think,
                prompt_token_ids=prompt_ids,
                enabled=enabled,
                call_start_id=self._call_start_id(request),
            )
        wants_tools = bool(request.tools) and (
            request.tool_choice is None or request.tool_choice.mode != "none"
        )
        tools = parser_for(model.family, model.tokenizer, request.tools or []) if wants_tools else None
        kept = {model.think.start_id, model.think.end_id} if model.think else set()
        if tools is not None:
            kept |= {i for i in model.marker_ids.values() if i is not None}
        return OutputProcessor(
            model.tokenizer,
            reasoning=reasoning,
            tools=tools,
            stops=request.sampling.stop,
            skip_ids=model.tokenizer.special_ids - kept,
        )


def _text_chars(request: GenerateRequest) -> int:
    """Characters of the text the client sent (prompt, contents; not reasoning, which templates
    drop from earlier turns): a prompt holds them all."""
    num = len(request.prompt or "")
    for message in request.messages or ():
        if isinstance(message.content, str):
            num += len(message.content)
        elif message.content:
            num += sum(len(part.text) for part in message.content if isinstance(part, TextPart))
    return num


def _reasons(request: GenerateRequest, is_free: bool) -> bool:
    """Reasoning is shown: the request does not switch it off and no grammar holds the answer."""
    return is_free and request.reasoning.enabled is not False

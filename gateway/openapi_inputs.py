"""A model's input in the OpenAPI document: its family's Struct plus the rules between fields that
JSON Schema can state and a Struct cannot (exactly one of `prompt` and `messages`; no `prompt` on
the OpenAI route). `/ai/run/{model}` is documented as one path per catalog model so each carries
its own input, as Cloudflare's own document does; `/ai/run` takes `{model, input}` with the input
that model's. What JSON Schema cannot state (fields a model refuses) is the operation's documented
400; a request over the context window is its documented 413 (5021, as Workers AI answers it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from schemas.catalog import ModelSpec

REF = "#/components/schemas/{name}"
FAMILY_INPUT = {"legacy": "LegacyInput", "openai": "ChatCompletionRequest"}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(name=name)}


def _present(name: str) -> dict[str, Any]:
    """`name` is given, and not as `null` (which the decoders read as absent)."""
    return {"required": [name], "properties": {name: {"not": {"type": "null"}}}}


EXACTLY_ONE_PROMPT_OR_MESSAGES = {"oneOf": [_present("prompt"), _present("messages")]}


def model_input(family: str) -> dict[str, Any]:
    """What `/ai/run` takes as a model's input (both families take `prompt` or `messages`)."""
    return {"allOf": [_ref(FAMILY_INPUT[family]), EXACTLY_ONE_PROMPT_OR_MESSAGES]}


def chat_completions_input() -> dict[str, Any]:
    """`/ai/v1/chat/completions`: OpenAI's body, so `messages` and never `prompt`."""
    return {
        "allOf": [
            _ref("ChatCompletionRequest"),
            _present("messages"),
            {"properties": {"prompt": {"type": "null"}}},
        ]
    }


def run_input(family: str) -> dict[str, Any]:
    """`/ai/run/{model}`: the model's input, a batch to queue (`queueRequest=true`), or a poll."""
    return {"anyOf": [model_input(family), _ref("BatchSubmit"), _ref("BatchPoll")]}


def envelope_input(models: Sequence[ModelSpec]) -> dict[str, Any]:
    """`/ai/run` with `{model, input}`: for each catalog model, that model's `run_input`."""
    inputs = [{"properties": {"model": {"const": m.name}, "input": run_input(m.family)}} for m in models]
    return {"allOf": [_ref("RunEnvelopeInput"), {"anyOf": inputs}]} if inputs else _ref("RunEnvelopeInput")

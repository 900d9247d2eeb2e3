"""The checkpoint's own chat template, rendered as transformers renders it (DESIGN.md §2 step 4).

The template is untrusted code from the checkpoint, so it runs in jinja2's
`ImmutableSandboxedEnvironment` with the environment transformers builds (`trim_blocks`,
`lstrip_blocks`, loop controls, the `{% generation %}` tag, and the globals/filters templates rely on:
`tojson` without HTML escaping, `raise_exception`, `strftime_now`, a safe `dict` and `namespace`).
The same template and the same variables therefore give the same text as `apply_chat_template`.

Reasoning switches travel under every name the families' templates read: `enable_thinking` (GLM),
`thinking` (Kimi K2.5), `reasoning_effort` (effort levels).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2

from backend.errors import InvalidRequest
from backend.text.jinja_sandbox import JinjaTemplate, template_source
from schemas.backend import ImagePart, Message, Reasoning, TextPart, Tool


def _arguments(text: str) -> Any:
    """Tool-call arguments as templates expect them (a mapping); text that is not JSON stays text."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def message_dict(message: Message) -> dict[str, Any]:
    """A `Message` in the OpenAI-style shape chat templates read."""
    out: dict[str, Any] = {"role": message.role}
    if isinstance(message.content, list):
        out["content"] = [
            {"type": "text", "text": p.text} if isinstance(p, TextPart) else {"type": "image"}
            for p in message.content
        ]
    else:
        out["content"] = message.content
    if message.reasoning_content is not None:
        out["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        out["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments)},
            }
            for c in message.tool_calls
        ]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:
        out["name"] = message.name
    return out


def tool_dict(tool: Tool) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
    }


def reasoning_kwargs(reasoning: Reasoning) -> dict[str, Any]:
    """The template variables each family reads for the reasoning switches; unset means model default."""
    out: dict[str, Any] = {}
    if reasoning.enabled is not None:
        out["enable_thinking"] = reasoning.enabled
        out["thinking"] = reasoning.enabled
    if reasoning.effort is not None:
        out["reasoning_effort"] = reasoning.effort
    return out


def images_of(messages: list[Message]) -> list[ImagePart]:
    """The image parts of a conversation, in the order the template places them."""
    return [p for m in messages if isinstance(m.content, list) for p in m.content if isinstance(p, ImagePart)]


class ChatTemplate:
    """One checkpoint's compiled template (`backend.text.jinja_sandbox`) over the internal `Message`s."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = JinjaTemplate(source, special_tokens)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InvalidRequest(f"the checkpoint's chat template does not compile: {exc}") from exc

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template a checkpoint folder ships (`backend.text.jinja_sandbox.template_source`), or None."""
        found = template_source(model_dir)
        return None if found is None else cls(*found)

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        reasoning: Reasoning | None = None,
        extra: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for `messages`. A template's own `raise_exception` becomes a 400, and so
        does a template that fails on what the messages hold (a checkpoint's template iterating a
        tool message's missing `content`): the input is what it cannot render."""
        variables: dict[str, Any] = dict(extra or {})
        variables.update(reasoning_kwargs(reasoning or Reasoning()))
        dicts = [message_dict(m) for m in messages]
        tool_dicts = [tool_dict(t) for t in tools] if tools else None
        try:
            return self._template.render(
                dicts, tools=tool_dicts, add_generation_prompt=add_generation_prompt, variables=variables
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template: {exc}") from exc
        except (TypeError, ValueError, LookupError) as exc:
            raise InvalidRequest(f"chat template cannot render these messages: {exc}") from exc

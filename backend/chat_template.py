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
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.errors import InvalidRequest
from backend.tokenizer import read_tokenizer_config
from schemas.backend import ImagePart, Message, Reasoning, TextPart, Tool

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
RESERVED_KWARGS = frozenset({"messages", "tools", "add_generation_prompt", "documents"})


class _GenerationTag(Extension):
    """`{% generation %}…{% endgeneration %}` marks assistant text for training masks; rendering keeps
    the body unchanged."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """`namespace()` that refuses underscore attributes (no reaching into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"templates cannot set underscore attribute {name!r}")


class _Dict:
    """`dict(...)` for templates without exposing the `dict` type itself (no `dict.mro()` tricks)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _Dict()
    env.globals["namespace"] = _Namespace
    return env


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
    """One checkpoint's compiled template plus the special tokens it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.exceptions.TemplateSyntaxError as exc:
            raise InvalidRequest(f"the checkpoint's chat template does not compile: {exc}") from exc
        self._special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> ChatTemplate | None:
        """The template of a checkpoint folder (`chat_template.jinja`, else tokenizer_config.json's
        `chat_template`, a string or the `default` of a named list), or None if it ships none."""
        folder = Path(model_dir)
        config = read_tokenizer_config(folder)
        specials = {}
        for key in SPECIAL_TOKEN_KEYS:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value
            if isinstance(value, str):
                specials[key] = value
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.exists():
            return cls(jinja_file.read_text(), specials)
        source = config.get("chat_template")
        if isinstance(source, list):
            named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
            source = named.get("default")
        return cls(source, specials) if isinstance(source, str) else None

    def render(
        self,
        messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        reasoning: Reasoning | None = None,
        extra: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt text for `messages`. A template's own `raise_exception` becomes a 400."""
        variables: dict[str, Any] = dict(self._special_tokens)
        variables.update({k: v for k, v in (extra or {}).items() if k not in RESERVED_KWARGS})
        variables.update(reasoning_kwargs(reasoning or Reasoning()))
        try:
            return self._template.render(
                messages=[message_dict(m) for m in messages],
                tools=[tool_dict(t) for t in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.exceptions.TemplateError as exc:
            raise InvalidRequest(f"chat template: {exc}") from exc

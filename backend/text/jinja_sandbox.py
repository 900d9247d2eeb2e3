"""The sandboxed jinja2 environment transformers renders chat templates in, and one compiled template
over OpenAI-style message dicts. Split from `backend.text.chat_template` so that code without msgspec (the
training recipe, `models/recipes/render.py`) renders prompts with exactly the code serving uses.
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

from backend.text.tokenizer import read_tokenizer_config

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


def template_source(model_dir: str | Path) -> tuple[str, dict[str, str]] | None:
    """(template, special tokens) of a checkpoint folder: `chat_template.jinja`, else
    tokenizer_config.json's `chat_template` (a string or the `default` of a named list); None if none."""
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
        return jinja_file.read_text(), specials
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    return (source, specials) if isinstance(source, str) else None


class JinjaTemplate:
    """One checkpoint's compiled template plus the special tokens it may refer to. Jinja's own
    errors (`TemplateSyntaxError` here, `TemplateError` from `render`) pass through."""

    def __init__(self, source: str, special_tokens: dict[str, str]) -> None:
        self._template = _environment().from_string(source)
        self.special_tokens = special_tokens

    @classmethod
    def from_checkpoint(cls, model_dir: str | Path) -> JinjaTemplate | None:
        found = template_source(model_dir)
        return None if found is None else cls(*found)

    def render(
        self,
        messages: list[dict[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        variables: dict[str, Any] | None = None,
    ) -> str:
        """The text for OpenAI-style `messages` and `tools` (`{"type": "function", "function": …}`)."""
        kwargs: dict[str, Any] = dict(self.special_tokens)
        kwargs.update({k: v for k, v in (variables or {}).items() if k not in RESERVED_KWARGS})
        return self._template.render(
            messages=messages, tools=tools or None, add_generation_prompt=add_generation_prompt, **kwargs
        )

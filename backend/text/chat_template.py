"""The checkpoint's own chat template, rendered as transformers renders it (DESIGN.md §2 step 4).

The template is untrusted code from the checkpoint, so it runs in jinja2's
`ImmutableSandboxedEnvironment` with the environment transformers builds (`trim_blocks`,
`lstrip_blocks`, loop controls, the `{% generation %}` tag, and the globals/filters templates rely on:
`tojson` without HTML escaping, `raise_exception`, `strftime_now`, a safe `dict` and `namespace`).
The same template and the same variables therefore give the same text as `apply_chat_template`.

Reasoning switches travel under every name the families' templates read: `enable_thinking` (GLM),
`thinking` (Kimi K2.5), `reasoning_effort` (effort levels).

Only the template's own markers become special tokens (`ChatTemplate.encode`). Every string the
client sent (message contents, names, tool calls and definitions, template variables) is handed to
the template with each special-token spelling in it replaced by a marker unique to the request
(ASCII letters and digits, so escaping, `tojson` and `strip` leave it whole); the rendered text is
encoded with specials allowed between markers, and each marker's spelling as plain text. So
`<|assistant|>` typed into GLM user content, or `<|im_end|><|im_system|>` into Kimi's, is ordinary
text to the model, not a role boundary.

A spelling can also form where the template writes two client strings back to back: Kimi K2.5's
writes a message's text parts one after another, so `hi<|i` and `m_end|>` in two parts rendered a real
`<|im_end|>`. So a message's text parts are quoted as one text (a spelling cut over parts is marked
in the part it starts in), and any client string that ends with the start of a control token's
spelling (two characters or more: `<|`, `<|im_e`) or begins with the end of one (`|>`, `m_end|>`)
gets a boundary marker there, and the rendered text is encoded apart at it: no special token spans
it. Text that neither ends nor begins so (nearly all) tokenizes exactly as before.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from pathlib import Path
from typing import Any

import jinja2

from backend.errors import InvalidRequest
from backend.text.jinja_sandbox import JinjaTemplate, template_source
from backend.text.tokenizer import Tokenizer
from schemas.backend import ImagePart, Message, Reasoning, TextPart, Tool

MAX_ARGUMENTS_DEPTH = 64  # a tool call's arguments in history, nested at most so deep


def _arguments(text: str) -> Any:
    """Tool-call arguments as templates expect them (a mapping); text that is not JSON stays text.
    Nested past `MAX_ARGUMENTS_DEPTH` they are refused (a 400): deeper, the parse or the template's
    walk over them ran out of stack, a 500 with a 150 KB traceback in the log for a 1.5 KB body."""
    too_deep = f"Tool call arguments are nested more than {MAX_ARGUMENTS_DEPTH} levels deep"
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    except RecursionError:  # deeper than the parser's stack
        raise InvalidRequest(too_deep) from None
    if _depth(value) > MAX_ARGUMENTS_DEPTH:
        raise InvalidRequest(too_deep)
    return value


def _depth(value: Any) -> int:
    """How deep a parsed JSON value nests (iteratively: it may be deeper than the stack)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if isinstance(item, dict):
            todo += [(v, depth + 1) for v in item.values()]
        elif isinstance(item, list):
            todo += [(v, depth + 1) for v in item]
    return deepest


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
        return self._render(messages, tools, reasoning, extra, add_generation_prompt, _Quoter(()))

    def encode(
        self,
        tokenizer: Tokenizer,
        messages: list[Message],
        *,
        tools: list[Tool] | None = None,
        reasoning: Reasoning | None = None,
        extra: dict[str, Any] | None = None,
    ) -> list[int]:
        """The prompt's token ids, with special tokens only where the template writes them: a
        special-token spelling the client typed is encoded as plain text (see the module docstring)."""
        quoter = _Quoter(tokenizer.special_spellings, _control_spellings(tokenizer))
        text = self._render(messages, tools, reasoning, extra, True, quoter)
        texts: list[str] = []  # the template's text between markers, specials read
        spellings: list[str] = []  # after each text: the quoted spelling it stands for ("" at a boundary)
        start = 0
        for found in quoter.markers.finditer(text):
            texts.append(text[start : found.start()])
            # by the marker's own index: a template may render client values in another order, or twice
            spellings.append(quoter.quoted[int(found.group(1))] if found.group(1) is not None else "")
            start = found.end()
        texts.append(text[start:])
        encoded = tokenizer.encode_many(texts)
        ids: list[int] = []
        for piece, spelling in zip(encoded, spellings, strict=False):
            ids += piece
            if spelling:
                ids += tokenizer.plain_ids(spelling)
        return ids + encoded[-1]

    def _render(
        self,
        messages: list[Message],
        tools: list[Tool] | None,
        reasoning: Reasoning | None,
        extra: dict[str, Any] | None,
        add_generation_prompt: bool,
        quoter: _Quoter,
    ) -> str:
        variables: dict[str, Any] = quoter.quote(dict(extra or {}))
        variables.update(reasoning_kwargs(reasoning or Reasoning()))
        dicts = quoter.quote([message_dict(m) for m in messages])
        tool_dicts = quoter.quote([tool_dict(t) for t in tools]) if tools else None
        try:
            return self._template.render(
                dicts, tools=tool_dicts, add_generation_prompt=add_generation_prompt, variables=variables
            )
        except (jinja2.exceptions.TemplateError, TypeError, ValueError, LookupError) as exc:
            # GLM's template reads a call's arguments as a mapping (`arguments.items()`): say which
            # call's are not one, not the template's "'str object' has no attribute 'items'"
            for i, m in enumerate(messages):
                for j, c in enumerate(m.tool_calls or []):
                    if not isinstance(_arguments(c.function.arguments), dict):
                        raise InvalidRequest(
                            f"messages[{i}].tool_calls[{j}].function.arguments must be a JSON object"
                        ) from exc
            if isinstance(exc, jinja2.exceptions.TemplateError):
                raise InvalidRequest(f"chat template: {exc}") from exc
            raise InvalidRequest(f"chat template cannot render these messages: {exc}") from exc


def _control_spellings(tokenizer: Tokenizer) -> tuple[str, ...]:
    special = tokenizer.special_ids
    return tuple(s for s in tokenizer.special_spellings if tokenizer.token_to_id(s) in special)


@functools.lru_cache(maxsize=16)
def _fragments(controls: tuple[str, ...]) -> tuple[frozenset[str], frozenset[str], int]:
    """(starts, ends, longest): the fragments a client value may not end / begin with unmarked, a
    control spelling's proper prefixes and suffixes of two characters or more (one, for a spelling
    of two: split between two values, a spelling of three or more characters leaves two on one
    side), and the longest spelling's length. Made once per tokenizer (Kimi's ~256 specials make
    ~60,000 fragments)."""
    split = [(s, min(2, len(s) - 1)) for s in controls if len(s) >= 2]
    starts = frozenset(s[:i] for s, m in split for i in range(m, len(s)))
    ends = frozenset(s[-i:] for s, m in split for i in range(m, len(s)))
    return starts, ends, max(map(len, controls), default=0)


def _is_text_part(value: Any) -> bool:
    return isinstance(value, dict) and value.get("type") == "text" and isinstance(value.get("text"), str)


# a prompt's client-typed special-token spellings: each costs its own pass (a red-team helper's
# 2.6 MB of `<sop><|user|>`, 400,000 of them, held the GIL 8 s a request)
MAX_QUOTED_SPELLINGS = 10_000


class _Quoter:
    """Replaces the special-token spellings inside client values with markers `kumo<nonce>q<i>x`, and
    marks with `kumo<nonce>b` a value's end that starts a spelling or its start that ends one (module
    docstring); the nonce is random per request, so a client cannot type a marker."""

    def __init__(self, spellings: tuple[str, ...], controls: tuple[str, ...] = ()) -> None:
        """`controls`: the spellings of special-flagged tokens (role and turn markers), whose
        fragments are bounded; an added token that is not one (GLM's `/nothink`, whose ends are
        `think` and `ink`) is quoted when typed whole, and its fragments are ordinary text."""
        unique = {s for s in spellings if s}
        longest_first = sorted(unique, key=len, reverse=True)
        self._spellings = re.compile("|".join(map(re.escape, longest_first))) if longest_first else None
        self._starts, self._ends, self._longest = _fragments(tuple(sorted(set(controls))))
        nonce = secrets.token_hex(8)
        self.markers = re.compile(f"kumo{nonce}(?:q(\\d+)x|b)")
        self._marker = f"kumo{nonce}q{{}}x"
        self._boundary = f"kumo{nonce}b"
        self.quoted: list[str] = []  # the spelling each marker stands for, by index

    def quote(self, value: Any) -> Any:
        """`value` (strings, lists, dicts, nested) with every special-token spelling marked."""
        if self._spellings is None:
            return value
        if isinstance(value, str):
            return self._bound(self._spellings.sub(self._mark, value))
        if isinstance(value, list):
            # a message's content parts: its text parts quoted as one text, whatever lies between
            # them (a template may write nothing for an image, as GLM's does)
            texts = [i for i, v in enumerate(value) if _is_text_part(v)]
            if len(texts) < 2:
                return [self.quote(v) for v in value]
            quoted = dict(zip(texts, self._quote_run([value[i]["text"] for i in texts]), strict=True))
            return [
                {self.quote(key): quoted[i] if key == "text" else self.quote(x) for key, x in v.items()}
                if i in quoted
                else self.quote(v)
                for i, v in enumerate(value)
            ]
        if isinstance(value, dict):
            return {self.quote(k): self.quote(v) for k, v in value.items()}
        return value

    def _quote_run(self, texts: list[str]) -> list[str]:
        """Text parts a template writes back to back, quoted as their concatenation: a spelling
        split over several parts (`hi<|i`, `m_end|>`) is marked in the part it starts in, its other
        characters taken out of the parts after (the rendered text is the same either way)."""
        assert self._spellings is not None
        joined = "".join(texts)
        found = list(self._spellings.finditer(joined))
        out: list[str] = []
        at = 0  # characters of `joined` consumed so far (a spelling may reach into later parts)
        end = 0
        for text in texts:
            start, end = end, end + len(text)
            pieces = []
            at = max(at, start)
            while found and found[0].start() < end:
                match = found.pop(0)
                pieces += [joined[at : match.start()], self._mark(match)]
                at = match.end()
            if at < end:
                pieces.append(joined[at:end])
                at = end
            out.append(self._bound("".join(pieces)))
        return out

    def _bound(self, text: str) -> str:
        """`text` with a boundary marker after an end that starts a spelling and before a start that
        ends one."""
        n = min(len(text), self._longest - 1)
        if any(text[-i:] in self._starts for i in range(1, n + 1)):
            text += self._boundary
        if any(text[:i] in self._ends for i in range(1, n + 1)):
            text = self._boundary + text
        return text

    def _mark(self, found: re.Match[str]) -> str:
        if len(self.quoted) == MAX_QUOTED_SPELLINGS:
            raise InvalidRequest(
                f"The messages spell special tokens more than {MAX_QUOTED_SPELLINGS} times "
                "(each is encoded as plain text)."
            )
        self.quoted.append(found.group())
        return self._marker.format(len(self.quoted) - 1)

"""Public inputs → internal `GenerateRequest`s (DESIGN §2 step 2).

Both families land here: the legacy Workers AI input and the OpenAI Chat Completions body of the
OpenAI-native entries. Every field is honoured or refused with a 400 that names it; a field that
changes nothing about the result (`user`, `metadata`, `store`, …) is accepted as is. `n` fans out
into n backend requests. Images are resolved to checked bytes here.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from gateway.errors import BadInput, Unsupported
from gateway.images import ImageFetcher
from schemas import backend as b
from schemas.catalog import ModelSpec
from schemas.openai import (
    AllowedToolsChoice,
    CustomChoice,
    FunctionCallChoice,
    FunctionChoice,
    ToolChoiceIn,
)
from schemas.workers_ai import LegacyFunction, LegacyInput, ToolSpec


@dataclass(frozen=True)
class Context:
    request_id: str
    tenant_salt: str
    images: ImageFetcher
    max_images: int
    max_choices: int
    max_image_bytes_total: int = 80 * 1024 * 1024  # image bytes × choices (GatewaySettings)
    num_choices: int = 1  # the request's n, once known: fetching stops where the images pass the cap
    fetched: list[int] = field(default_factory=list)  # bytes of each image fetched so far


def check_image_bytes(image_bytes: int, ctx: Context) -> None:
    """A request's image bytes times its choices within `max_image_bytes_total`: each choice's
    backend request carries every image."""
    if image_bytes * ctx.num_choices > ctx.max_image_bytes_total:
        raise BadInput(
            f"Bad input: the images total {image_bytes} bytes, and each of the {ctx.num_choices} choices "
            f"carries them all: more than {ctx.max_image_bytes_total} bytes (send fewer or smaller images, "
            "or fewer choices)"
        )


@dataclass(frozen=True)
class Normalized:
    """What the route needs: one backend request per choice, and how to render the answer."""

    requests: list[b.GenerateRequest]
    stream: bool
    json_mode: bool
    include_usage: bool = False
    logprobs: bool = False
    # a routing key from the body (OpenAI's `prompt_cache_key`): requests that share it go to one
    # replica, whose prefix cache then holds their common prompt (the `x-session-affinity` header wins)
    affinity: str | None = None


MAX_SCHEMA_DEPTH = 32  # JSON Schemas (tool parameters, response formats) the backend compiles


def check_depth(value: object, field: str, depth: int = 0) -> None:
    """Free-form JSON (schemas) may not nest deeper than `MAX_SCHEMA_DEPTH`."""
    if depth > MAX_SCHEMA_DEPTH:
        raise BadInput(f"Bad input: '{field}' is nested more than {MAX_SCHEMA_DEPTH} levels deep")
    if isinstance(value, dict):
        for item in value.values():
            check_depth(item, field, depth + 1)
    elif isinstance(value, list):
        for item in value:
            check_depth(item, field, depth + 1)


def given(**fields: Any) -> dict[str, Any]:
    """The fields a caller set (not None): the others keep the defaults of `schemas.backend`, which
    are written there alone."""
    return {name: value for name, value in fields.items() if value is not None}


def refuse(field: str, why: str = "is not supported by this model") -> Unsupported:
    return Unsupported(f"Bad input: '{field}' {why}")


# ---- shared pieces -------------------------------------------------------------------------------------
def tools_of(
    specs: list[ToolSpec] | None, functions: list[LegacyFunction] | None, field: str
) -> list[b.Tool] | None:
    """Both tool shapes (flat and `{type: function, function: {...}}`), plus OpenAI's `functions`."""
    out: list[b.Tool] = []
    for i, spec in enumerate(specs or []):
        if spec.type not in (None, "function"):
            raise refuse(f"{field}[{i}].type", f"'{spec.type}' is not supported (function tools only)")
        if spec.function is not None:
            fn = spec.function
            out.append(b.Tool(name=fn.name, description=fn.description, parameters=fn.parameters))
        elif spec.name:
            out.append(b.Tool(name=spec.name, description=spec.description, parameters=spec.parameters or {}))
        else:
            raise BadInput(f"Bad input: '{field}[{i}]' needs a name or a function")
    for fn in functions or []:
        out.append(b.Tool(name=fn.name, description=fn.description, parameters=fn.parameters))
    for i, tool in enumerate(out):
        if not TOOL_NAME.fullmatch(tool.name):
            shown = tool.name if len(tool.name) <= 64 else tool.name[:64] + "…"
            raise BadInput(
                f"Bad input: '{field}[{i}]' name {shown!r} must be 1 to 64 letters, digits, underscores "
                "or dashes (OpenAI's rule; a call's markup spells the name, so nothing else can be parsed back)"
            )
        check_depth(tool.parameters, f"{field}[{i}].parameters")
    return out or None


TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def tool_choice_of(
    choice: ToolChoiceIn | None, tools: list[b.Tool] | None
) -> tuple[b.ToolChoice | None, list[b.Tool] | None]:
    """`tool_choice` → internal choice; `allowed_tools` narrows the tools to those it names."""
    if choice is None:
        return None, tools
    names = {t.name for t in tools or []}
    if isinstance(choice, str):
        if choice == "required" and not tools:
            raise BadInput("Bad input: 'tool_choice' is required but no tools were given")
        return b.ToolChoice(mode=choice), tools
    if isinstance(choice, FunctionChoice):
        if choice.function.name not in names:
            raise BadInput(
                f"Bad input: 'tool_choice' names '{choice.function.name}', which is not among the tools"
            )
        return b.ToolChoice(mode="function", name=choice.function.name), tools
    if isinstance(choice, AllowedToolsChoice):
        allowed = choice.allowed_tools
        if any(isinstance(t, CustomChoice) for t in allowed.tools):
            raise refuse("tool_choice.allowed_tools.tools", "may only name function tools")
        keep = {t.function.name for t in allowed.tools if isinstance(t, FunctionChoice)}
        if not keep <= names:
            raise BadInput("Bad input: 'tool_choice.allowed_tools' names tools that were not given")
        return b.ToolChoice(mode=allowed.mode), [t for t in tools or [] if t.name in keep]
    raise refuse("tool_choice", "type 'custom' is not supported")


def from_function_call(call: FunctionCallChoice | None) -> ToolChoiceIn | None:
    """The deprecated `function_call` as the `tool_choice` it stands for."""
    if call is None or isinstance(call, str):
        return call
    return FunctionChoice(function=call)


def reasoning_of(model: ModelSpec, effort: str | None, enable_thinking: bool | None) -> b.Reasoning:
    """`reasoning_effort` with the model's aliases (reference §5) and `enable_thinking`."""
    if effort is None and enable_thinking is None:
        return b.Reasoning()
    if not model.reasoning:
        raise refuse("reasoning_effort" if effort is not None else "chat_template_kwargs.enable_thinking")
    level: str | None = None
    spec = model.reasoning_effort
    if effort is not None:
        if spec is None:
            raise refuse(
                "reasoning_effort",
                "is not supported by this model (use chat_template_kwargs.enable_thinking)",
            )
        level = spec.aliases.get(effort, effort)
        if level not in spec.levels:
            allowed = sorted({*spec.levels, *spec.aliases})
            raise BadInput(f"Bad input: 'reasoning_effort' must be one of {', '.join(allowed)}")
    enabled = not (level == "none" or enable_thinking is False)
    if not enabled and spec is not None and not spec.can_disable:
        raise refuse("reasoning_effort", "cannot disable reasoning on this model")
    internal = level if level in ("low", "medium", "high", "max") else None
    return b.Reasoning(enabled=enabled, effort=internal)  # type: ignore[arg-type]


def check_capabilities(
    model: ModelSpec, messages: list[b.Message] | None, tools: list[b.Tool] | None, max_images: int
) -> None:
    num_images = sum(
        isinstance(part, b.ImagePart)
        for m in messages or []
        if isinstance(m.content, list)
        for part in m.content
    )
    check_images(model, num_images, max_images)
    if tools and not model.function_calling:
        raise refuse("tools")


def check_images(model: ModelSpec, num_images: int, max_images: int) -> None:
    """Vision and the image count; called before any URL is fetched, so a refused request costs
    no outbound fetch."""
    if num_images and not model.vision:
        raise Unsupported(f"Bad input: model {model.name} does not support image inputs")
    if num_images > max_images:
        raise BadInput(f"Bad input: at most {max_images} images per request")


def check_choices(n: int, ctx: Context) -> None:
    """`n` within the configured number of choices (each is a backend request)."""
    if n > ctx.max_choices:
        raise BadInput(f"Bad input: 'n' must be at most {ctx.max_choices}")


def fan_out(base: b.GenerateRequest, n: int, ctx: Context) -> list[b.GenerateRequest]:
    """n choices → n requests; a given seed s becomes s, s+1, … so choices differ reproducibly (each
    carries every image: `check_image_bytes` capped them as they were fetched)."""
    check_choices(n, ctx)
    out = []
    for i in range(n):
        seed = base.sampling.seed
        sampling = msgspec.structs.replace(base.sampling, seed=None if seed is None else (seed + i) % 2**63)
        out.append(msgspec.structs.replace(base, request_id=f"{ctx.request_id}-{i}", sampling=sampling))
    return out


# ---- legacy family -------------------------------------------------------------------------------------
async def from_legacy(inp: LegacyInput, model: ModelSpec, ctx: Context) -> Normalized:
    if (inp.prompt is None) == (inp.messages is None):
        raise BadInput("Bad input: exactly one of 'prompt' and 'messages' is required")
    if inp.lora is not None:
        raise Unsupported(f"The model {model.name} does not support LoRa inference")
    if inp.functions:
        raise refuse("functions", "(embedded function calling) is not supported")
    json_schema = inp.guided_json
    fmt = None
    if inp.response_format is not None and inp.response_format.type != "text":
        fmt = b.ResponseFormat(type=inp.response_format.type, json_schema=inp.response_format.json_schema)
    elif json_schema is not None:
        fmt = b.ResponseFormat(type="json_schema", json_schema=json_schema)
    if fmt is not None:
        check_depth(fmt.json_schema, "response_format")
    if fmt is not None and inp.stream:
        raise BadInput("Bad input: JSON mode does not support streaming; drop 'stream' or 'response_format'")
    messages: list[b.Message] | None = None
    prompt: str | None = None
    if inp.raw:
        if inp.prompt is None or inp.image is not None:
            raise BadInput("Bad input: 'raw' needs 'prompt' and no 'image'")
        prompt = inp.prompt
    else:
        messages = [b.Message(role="user", content=inp.prompt)] if inp.prompt is not None else []
        for i, m in enumerate(inp.messages or []):
            calls = [
                _legacy_call(c, f"messages[{i}].tool_calls[{j}]") for j, c in enumerate(m.tool_calls or [])
            ]
            role = "system" if m.role == "developer" else m.role
            messages.append(
                b.Message(
                    role=role,
                    content=m.content,
                    tool_calls=calls or None,
                    tool_call_id=m.tool_call_id,
                    name=m.name,
                )
            )
        if inp.image is not None:
            _attach(messages, ctx.images.from_legacy(inp.image))
    tools = tools_of(inp.tools, None, "tools")
    check_capabilities(model, messages, tools, ctx.max_images)
    sampling = b.SamplingParams(
        max_tokens=inp.max_tokens,
        temperature=inp.temperature,
        seed=inp.seed,
        **given(
            top_p=inp.top_p,
            top_k=inp.top_k,
            repetition_penalty=inp.repetition_penalty,
            frequency_penalty=inp.frequency_penalty,
            presence_penalty=inp.presence_penalty,
        ),
    )
    request = b.GenerateRequest(
        request_id=f"{ctx.request_id}-0",
        tenant_salt=ctx.tenant_salt,
        messages=messages,
        prompt=prompt,
        raw=inp.raw,
        tools=tools,
        sampling=sampling,
        response_format=fmt,
        reasoning=b.Reasoning(enabled=False)
        if model.reasoning
        else b.Reasoning(),  # the legacy output has no place for it
        reject_if_busy=bool(inp.options and inp.options.rejectIfBusy),
    )
    return Normalized(requests=[request], stream=inp.stream, json_mode=fmt is not None)


def _legacy_call(call: dict[str, Any], field: str) -> b.ToolCall:
    """A tool call in history, in either shape: `{name, arguments: {...}}` or OpenAI's."""
    fn = call.get("function", call)
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise BadInput(f"Bad input: '{field}' needs a name")
    args = fn.get("arguments", {})
    text = args if isinstance(args, str) else msgspec.json.encode(args).decode()
    return b.ToolCall(
        id=str(call.get("id") or f"call_{field.rsplit('[', 1)[-1].rstrip(']')}"),
        function=b.ToolCallFunction(name=fn["name"], arguments=text),
    )


def _attach(messages: list[b.Message], image: b.ImagePart) -> None:
    """The legacy top-level `image` belongs to the last user message."""
    for i in range(len(messages) - 1, -1, -1):
        content = messages[i].content
        if messages[i].role == "user":
            text = content if isinstance(content, str) else ""
            messages[i] = msgspec.structs.replace(messages[i], content=[image, b.TextPart(text=text)])
            return
    messages.append(b.Message(role="user", content=[image]))

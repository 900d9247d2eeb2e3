"""OpenAI Chat Completions bodies → internal `GenerateRequest`s (the OpenAI-native family).

Each field of the published schema is honoured or refused by name (see `from_openai`); the shared
pieces (tools, tool choice, reasoning, fan-out) live in `gateway.normalize`.
"""

from __future__ import annotations

from dataclasses import replace

from gateway.errors import BadInput
from gateway.normalize import (
    Context,
    Normalized,
    check_capabilities,
    check_choices,
    check_depth,
    check_image_bytes,
    check_images,
    fan_out,
    from_function_call,
    given,
    reasoning_of,
    refuse,
    tool_choice_of,
    tools_of,
)
from schemas import backend as b
from schemas.catalog import ModelSpec
from schemas.openai import (
    AssistantMessage,
    ChatCompletionRequest,
    Content,
    DeveloperMessage,
    FunctionMessage,
    ImagePartIn,
    MessageIn,
    RefusalPartIn,
    SystemMessage,
    TextPartIn,
    ToolMessage,
    UserMessage,
)


async def from_openai(
    inp: ChatCompletionRequest, model: ModelSpec, ctx: Context, *, allow_prompt: bool
) -> Normalized:
    """Honoured: messages/prompt, sampling, stop, seed, n, logprobs, tools, tool_choice,
    parallel_tool_calls, functions/function_call, response_format, reasoning_effort,
    chat_template_kwargs, stream, stream_options. Refused: audio output, logit_bias,
    web_search_options, custom tools, non-image media parts. No effect: user, metadata, store,
    service_tier, prediction (a latency hint)."""
    for field in ("audio", "web_search_options"):
        if getattr(inp, field) is not None:
            raise refuse(field)
    if inp.modalities and inp.modalities != ["text"]:
        raise refuse("modalities", "may only be ['text']")
    if inp.logit_bias:
        raise refuse("logit_bias")
    if inp.top_logprobs and not inp.logprobs:
        raise BadInput("Bad input: 'top_logprobs' requires 'logprobs' to be true")
    if inp.prompt is not None and not allow_prompt:
        raise refuse("prompt", "is not a Chat Completions field; send 'messages'")
    if not allow_prompt and inp.messages is None:
        raise BadInput("Bad input: 'messages' is required")
    if (inp.prompt is None) == (inp.messages is None):
        raise BadInput("Bad input: exactly one of 'prompt' and 'messages' is required")
    check_choices(num_choices_of(inp), ctx)  # this and the images' checks before any image is fetched
    ctx = replace(ctx, num_choices=num_choices_of(inp), fetched=[])
    check_images(model, _num_images(inp.messages or []), ctx.max_images)
    check_tool_results(inp.messages or [])
    messages = [b.Message(role="user", content=inp.prompt)] if inp.prompt is not None else []
    for i, m in enumerate(inp.messages or []):
        messages.append(await _message(m, f"messages[{i}]", ctx))
    tools = tools_of(inp.tools, inp.functions, "tools")
    choice, tools = tool_choice_of(
        inp.tool_choice if inp.tool_choice is not None else from_function_call(inp.function_call), tools
    )
    check_capabilities(model, messages, tools, ctx.max_images)
    kwargs = inp.chat_template_kwargs
    reasoning = reasoning_of(model, inp.reasoning_effort, kwargs.enable_thinking if kwargs else None)
    template_kwargs = (
        {"clear_thinking": kwargs.clear_thinking} if kwargs and kwargs.clear_thinking is not None else None
    )
    fmt = None
    if inp.response_format is not None and inp.response_format.type != "text":
        spec = inp.response_format.json_schema
        if inp.response_format.type == "json_schema" and (spec is None or spec.schema is None):
            raise BadInput("Bad input: 'response_format.json_schema.schema' is required for type json_schema")
        fmt = b.ResponseFormat(type=inp.response_format.type, json_schema=spec.schema if spec else None)
        check_depth(fmt.json_schema, "response_format.json_schema.schema")
    stop = [inp.stop] if isinstance(inp.stop, str) else list(inp.stop or [])
    sampling = b.SamplingParams(
        max_tokens=max_tokens_of(inp, model),
        seed=None if inp.seed is None else inp.seed % 2**63,
        stop=stop,
        **given(
            # top_p 0 keeps only the likeliest token: greedy, as temperature 0 (top_p keeps its default)
            temperature=0.0 if inp.top_p == 0 else inp.temperature,
            top_p=inp.top_p or None,
            frequency_penalty=inp.frequency_penalty,
            presence_penalty=inp.presence_penalty,
            logprobs=inp.logprobs,
            top_logprobs=inp.top_logprobs,
        ),
    )
    base = b.GenerateRequest(
        request_id=f"{ctx.request_id}-0",
        tenant_salt=ctx.tenant_salt,
        messages=messages,
        tools=tools,
        tool_choice=choice,
        sampling=sampling,
        reasoning=reasoning,
        response_format=fmt,
        chat_template_kwargs=template_kwargs,
        reject_if_busy=bool(inp.options and inp.options.rejectIfBusy),
        **given(parallel_tool_calls=inp.parallel_tool_calls),
    )
    return Normalized(
        requests=fan_out(base, num_choices_of(inp), ctx),
        stream=bool(inp.stream),
        json_mode=fmt is not None,
        include_usage=bool(inp.stream_options and inp.stream_options.include_usage),
        logprobs=bool(inp.logprobs),
        affinity=inp.prompt_cache_key or None,
    )


def max_tokens_of(inp: ChatCompletionRequest, model: ModelSpec) -> int:
    """Each choice's token budget: `max_completion_tokens`, else the deprecated `max_tokens`, else
    the model's default."""
    return inp.max_completion_tokens or inp.max_tokens or model.default_max_tokens


def num_choices_of(inp: ChatCompletionRequest) -> int:
    """`n`, 1 when absent."""
    return inp.n or 1


def num_images_of(inp: ChatCompletionRequest) -> int:
    """Image parts in the input, data: URIs and URLs alike, counted before any is fetched."""
    return _num_images(inp.messages or [])


def image_urls_of(inp: ChatCompletionRequest) -> list[str]:
    """The image parts' URLs (data: URIs or http(s) URLs), in input order, before any is fetched."""
    return [part.image_url.url for part in _image_parts(inp.messages or [])]


def check_tool_results(messages: list[MessageIn]) -> None:
    """OpenAI's rule: a `tool` message answers a call of the assistant message before it (its other
    results between them). A result for no call would reach the model as a transcript it never
    wrote (the chat templates render results by their call's id)."""
    calls: set[str] | None = None  # the ids the latest assistant message called, while results follow
    for i, m in enumerate(messages):
        if isinstance(m, AssistantMessage):
            calls = {c.id for c in m.tool_calls or []}
        elif isinstance(m, ToolMessage):
            if calls is None or m.tool_call_id not in calls:
                raise BadInput(
                    f"Bad input: 'messages[{i}].tool_call_id' ({m.tool_call_id!r}) answers no tool call of "
                    "the assistant message before it"
                )
        elif not isinstance(m, FunctionMessage):
            calls = None


def _num_images(messages: list[MessageIn]) -> int:
    """Image parts in the input, counted before any of them is fetched."""
    return len(_image_parts(messages))


def _image_parts(messages: list[MessageIn]) -> list[ImagePartIn]:
    return [
        part
        for m in messages
        if not isinstance(m, FunctionMessage) and isinstance(m.content, list)
        for part in m.content
        if isinstance(part, ImagePartIn)
    ]


async def _message(m: MessageIn, field: str, ctx: Context) -> b.Message:
    if isinstance(m, SystemMessage | DeveloperMessage):
        return b.Message(role="system", content=await _content(m.content, field, ctx), name=m.name)
    if isinstance(m, UserMessage):
        return b.Message(role="user", content=await _content(m.content, field, ctx), name=m.name)
    if isinstance(m, ToolMessage):
        return b.Message(
            role="tool", content=await _content(m.content, field, ctx), tool_call_id=m.tool_call_id
        )
    if isinstance(m, FunctionMessage):
        return b.Message(role="tool", content=m.content, name=m.name)
    assert isinstance(m, AssistantMessage)
    if m.audio is not None:
        raise refuse(f"{field}.audio")
    calls: list[b.ToolCall] = []
    for j, call in enumerate(m.tool_calls or []):
        if call.function is None:
            raise refuse(f"{field}.tool_calls[{j}]", "must be a function call")
        calls.append(
            b.ToolCall(
                id=call.id,
                function=b.ToolCallFunction(name=call.function.name, arguments=call.function.arguments),
            )
        )
    if m.function_call is not None:
        calls.append(
            b.ToolCall(
                id="call_0",
                function=b.ToolCallFunction(name=m.function_call.name, arguments=m.function_call.arguments),
            )
        )
    return b.Message(
        role="assistant",
        content=await _content(m.content, field, ctx),
        reasoning_content=m.reasoning_content if m.reasoning_content is not None else m.reasoning,
        tool_calls=calls or None,
        name=m.name,
    )


async def _content(content: Content, field: str, ctx: Context) -> str | list[b.ContentPart] | None:
    """Text parts are joined into one string unless an image is among them."""
    if content is None or isinstance(content, str):
        return content
    parts: list[b.ContentPart] = []
    for j, part in enumerate(content):
        if isinstance(part, TextPartIn):
            parts.append(b.TextPart(text=part.text))
        elif isinstance(part, RefusalPartIn):
            parts.append(b.TextPart(text=part.refusal))
        elif isinstance(part, ImagePartIn):
            image = await ctx.images.from_url(part.image_url.url)
            ctx.fetched.append(len(image.data))
            check_image_bytes(sum(ctx.fetched), ctx)  # no image fetched past the cap
            parts.append(image)
        else:
            raise refuse(
                f"{field}.content[{j}].type", f"'{type(part).__struct_config__.tag}' is not supported"
            )
    if all(isinstance(p, b.TextPart) for p in parts):
        return "".join(p.text for p in parts if isinstance(p, b.TextPart))
    return parts

"""The OpenAI Responses API (`POST …/ai/v1/responses`) over the Chat Completions service.

A Responses body becomes the Chat Completions request it means (`instructions` the first system
message, input items the messages: a `function_call` an assistant tool call, its
`function_call_output` a tool message, a `reasoning` item the next assistant turn's
`reasoning_content`), runs through the same `InferenceService`, and the answer comes back as a
Response: a `reasoning` item, a `message` item, one `function_call` item per call, usage with the
call's neurons. Streams are the chat chunks re-read as Responses events (`response.created`, item
and part added / delta / done, `response.completed` or `response.incomplete`). Nothing is stored:
`store` is answered `false`; `previous_response_id` is refused, the conversation travels whole.
`include: ["message.output_text.logprobs"]` puts the answer's token logprobs on its `output_text`
and on each text delta (`top_logprobs` alternatives each), as chat completions' `logprobs` would.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from msgspec import UNSET

from gateway.errors import BadInput
from gateway.inference import Answer, Stream
from gateway.usage import neurons
from schemas import responses as r
from schemas.catalog import ModelSpec
from schemas.openai import ChatCompletion, ChatCompletionRequest, ChoiceLogprobs, ChunkChoice, CompletionUsage

_FINISHED_AT_LIMIT = "length"
LOGPROBS = "message.output_text.logprobs"
# the `include` values OpenAI defines; only LOGPROBS has something here to add (no built-in tools,
# no stored images, reasoning in the clear), the others are accepted and add nothing
KNOWN_INCLUDES = frozenset(
    {
        LOGPROBS,
        "reasoning.encrypted_content",
        "message.input_image.image_url",
        "file_search_call.results",
        "web_search_call.results",
        "web_search_call.action.sources",
        "computer_call_output.output.image_url",
        "code_interpreter_call.outputs",
    }
)
Status = Literal["completed", "incomplete"]


def to_chat(body: r.ResponsesRequest) -> ChatCompletionRequest:
    """The Chat Completions request a Responses body means; a 400 names what cannot be served."""
    if body.previous_response_id is not None or body.conversation is not None:
        raise BadInput(
            "Bad input: responses are not stored here (store is false); "
            "send the whole conversation as `input` instead of previous_response_id / conversation"
        )
    if body.background:
        raise BadInput("Bad input: background responses are not supported")
    if body.input is None:
        raise BadInput("Bad input: 'input' is required")
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
    else:
        messages += _messages(body.input)
    chat: dict[str, Any] = {"model": body.model, "messages": messages}
    if body.tools:
        chat["tools"] = [
            {"type": "function", "function": {"name": t.name, "description": t.description or "",
             "parameters": t.parameters or {"type": "object", "properties": {}}}}
            for t in body.tools
        ]  # fmt: skip
    if isinstance(body.tool_choice, r.NamedFunctionChoice):
        chat["tool_choice"] = {"type": "function", "function": {"name": body.tool_choice.name}}
    elif body.tool_choice is not None:
        chat["tool_choice"] = body.tool_choice
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type == "json_schema":
        spec = {"name": fmt.name or "response", "schema": fmt.schema, "strict": fmt.strict}
        chat["response_format"] = {"type": "json_schema", "json_schema": spec}
    elif fmt is not None:
        chat["response_format"] = {"type": fmt.type}
    if body.reasoning is not None and body.reasoning.effort is not None:
        chat["reasoning_effort"] = body.reasoning.effort
    for src, dst in (
        ("max_output_tokens", "max_completion_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("parallel_tool_calls", "parallel_tool_calls"),
        ("user", "user"),
        ("prompt_cache_key", "prompt_cache_key"),
    ):
        if getattr(body, src) is not None:
            chat[dst] = getattr(body, src)
    for i, name in enumerate(body.include or []):
        if name not in KNOWN_INCLUDES:
            raise BadInput(
                f"Bad input: $.include[{i}]: unknown value {name!r}; one of {sorted(KNOWN_INCLUDES)}"
            )
    if LOGPROBS in (body.include or []):  # as OpenAI: `top_logprobs` alone adds none
        chat["logprobs"] = True
        chat["top_logprobs"] = body.top_logprobs or 0
    if body.stream:
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    try:
        return msgspec.convert(chat, ChatCompletionRequest)
    except msgspec.ValidationError as exc:
        raise BadInput(f"Bad input: {exc}") from exc


def _messages(items: list[r.InputItem]) -> list[dict[str, Any]]:
    """Input items → chat messages. Consecutive function calls share one assistant turn; a reasoning
    item rides on the assistant turn after it."""
    messages: list[dict[str, Any]] = []
    reasoning: str | None = None
    called: set[str] = set()
    for i, item in enumerate(items):
        where = f"$.input[{i}]"
        if item.type == "reasoning":
            parts = [*(item.content or []), *(item.summary or [])]
            reasoning = "".join(p.text for p in parts if isinstance(p, r.ReasoningTextIn | r.SummaryTextIn))
        elif item.type == "function_call":
            if item.call_id is None or item.name is None or item.arguments is None:
                raise BadInput(f"Bad input: {where} (function_call) needs call_id, name and arguments")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            called.add(item.call_id)
            last = messages[-1] if messages else None
            if (turn := _awaiting_outputs(messages)) is not None:
                _fold_reasoning(turn, reasoning)
                reasoning = None
                turn["tool_calls"].append(call)
            elif last is not None and last["role"] == "assistant" and reasoning is None:
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append(_assistant(None, reasoning, [call]))
                reasoning = None
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise BadInput(f"Bad input: {where} (function_call_output) needs call_id and output")
            if item.call_id not in called:
                raise BadInput(f"Bad input: {where} (function_call_output): no function_call before it has call_id "
                               f"{item.call_id!r}")  # fmt: skip
            output = item.output if isinstance(item.output, str) else "".join(p.text for p in item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        else:
            if item.role is None or item.content is None:
                raise BadInput(f"Bad input: {where} (message) needs role and content")
            if item.role == "assistant" and (turn := _awaiting_outputs(messages)) is not None:
                _fold_reasoning(turn, reasoning)
                reasoning = None
                turn["content"] = (turn["content"] or "") + _text_of(item.content)
            elif item.role == "assistant":
                messages.append(_assistant(_text_of(item.content), reasoning, None))
                reasoning = None
            else:
                messages.append({"role": item.role, "content": _content(item.content, where)})
    return messages


def _awaiting_outputs(messages: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The last message when it is an assistant turn whose calls await their outputs: the items a
    response writes after a call (its text, more reasoning and calls: `[rs, fc, rs, fc]`,
    `[fc, message]`) belong to that turn, as a chat's one assistant message holds them, so that the
    outputs answer the turn before them."""
    last = messages[-1] if messages else None
    return last if last is not None and last["role"] == "assistant" and last.get("tool_calls") else None


def _fold_reasoning(turn: dict[str, Any], reasoning: str | None) -> None:
    """`reasoning` (a reasoning item's text, pending) added to `turn`'s."""
    if reasoning is not None:
        turn["reasoning_content"] = (turn.get("reasoning_content") or "") + reasoning
    return None


def _assistant(text: str | None, reasoning: str | None, calls: list[dict[str, Any]] | None) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message


def _text_of(content: str | list[r.ContentPartIn]) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, r.OutputTextIn | r.InputText))


def _content(content: str | list[r.ContentPartIn], where: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, r.InputText | r.OutputTextIn):
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, r.InputImage):
            if part.image_url is None:
                raise BadInput(
                    f"Bad input: {where}.content[{j}]: images by file_id are not supported; send image_url"
                )
            parts.append({"type": "image_url", "image_url": {"url": part.image_url, "detail": part.detail}})
        else:
            raise BadInput(f"Bad input: {where}.content[{j}] cannot be part of an input message")
    return parts


# ---- answers -----------------------------------------------------------------------------------------
@dataclass
class Echo:
    """What a Response repeats of its request."""

    instructions: str | None
    max_output_tokens: int | None
    parallel_tool_calls: bool
    reasoning: dict[str, Any]
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None
    user: str | None
    metadata: dict[str, str]

    @classmethod
    def of(cls, body: r.ResponsesRequest) -> Echo:
        choice = body.tool_choice
        return cls(
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            parallel_tool_calls=body.parallel_tool_calls is not False,
            reasoning=msgspec.to_builtins(body.reasoning)
            if body.reasoning
            else {"effort": None, "summary": None},
            temperature=body.temperature,
            text=msgspec.to_builtins(body.text) if body.text else {"format": {"type": "text"}},
            tool_choice=msgspec.to_builtins(choice) if choice is not None else "auto",
            tools=[msgspec.to_builtins(t) for t in body.tools or []],
            top_p=body.top_p,
            user=body.user,
            metadata=dict(body.metadata or {}),
        )


def _usage(usage: CompletionUsage, model: ModelSpec) -> r.ResponseUsage:
    cached = usage.prompt_tokens_details.cached_tokens or 0
    details = usage.completion_tokens_details
    reasoning_tokens = 0 if details is UNSET else details.reasoning_tokens
    return r.ResponseUsage(
        input_tokens=usage.prompt_tokens,
        input_tokens_details=r.InputTokensDetails(cached_tokens=cached),
        output_tokens=usage.completion_tokens,
        output_tokens_details=r.OutputTokensDetails(reasoning_tokens=reasoning_tokens),
        total_tokens=usage.total_tokens,
        neurons=round(neurons(model.price, usage.prompt_tokens, cached, usage.completion_tokens), 4),
    )


def _response(
    id: str, created: int, model: ModelSpec, echo: Echo, output: list[r.OutputItem], *,
    status: Any, finish: str | None, usage: r.ResponseUsage | None,
) -> r.Response:  # fmt: skip
    return r.Response(
        id=id, created_at=created, status=status, model=model.name, output=output, usage=usage,
        incomplete_details=r.IncompleteDetails(reason="max_output_tokens") if finish == _FINISHED_AT_LIMIT else None,
        instructions=echo.instructions, max_output_tokens=echo.max_output_tokens,
        parallel_tool_calls=echo.parallel_tool_calls, reasoning=echo.reasoning, temperature=echo.temperature,
        text=echo.text, tool_choice=echo.tool_choice, tools=echo.tools, top_p=echo.top_p, user=echo.user,
        metadata=echo.metadata,
    )  # fmt: skip


def _item_id(kind: str) -> str:
    return f"{kind}_{uuid.uuid4().hex}"


def response_of(answer: Answer, model: ModelSpec, echo: Echo, id: str) -> r.Response:
    """A whole answer (one Chat Completion choice) as a Response."""
    completion = answer.body
    assert isinstance(completion, ChatCompletion)
    choice = completion.choices[0]
    message, finish = choice.message, choice.finish_reason
    status: Status = "incomplete" if finish == _FINISHED_AT_LIMIT else "completed"
    output: list[r.OutputItem] = []
    if message.reasoning_content:
        output.append(
            r.ReasoningItem(id=_item_id("rs"), content=[r.ReasoningText(text=message.reasoning_content)])
        )
    if message.content:
        logprobs = _logprobs(choice.logprobs)
        text = r.OutputText(text=message.content, logprobs=logprobs)
        output.append(r.MessageItem(id=_item_id("msg"), status=status, content=[text]))
    for call in message.tool_calls or []:
        output.append(
            r.FunctionCallItem(
                id=_item_id("fc"), call_id=call.id, name=call.function.name or "",
                arguments=call.function.arguments, status="completed",
            )
        )  # fmt: skip
    usage = _usage(completion.usage, model)
    return _response(id, completion.created, model, echo, output, status=status, finish=finish, usage=usage)


def _logprobs(logprobs: ChoiceLogprobs | None) -> list[Any]:
    """A chat choice's (or chunk's) content logprobs as an `output_text`'s: the same entries."""
    return msgspec.to_builtins(logprobs.content or []) if logprobs is not None else []


class _Frame(msgspec.Struct):
    """A chat chunk as `gateway.render` writes it, or its in-stream error."""

    choices: list[ChunkChoice] = []
    usage: CompletionUsage | None = None
    error: dict[str, Any] | None = None


_frame_decoder = msgspec.json.Decoder(_Frame)


@dataclass
class _Open:
    """The output item the stream is writing."""

    index: int
    item: r.OutputItem
    text: str = ""
    logprobs: list[Any] = field(default_factory=list)


@dataclass
class EventWriter:
    """Chat chunks → Responses events, numbered in order."""

    id: str
    created: int
    model: ModelSpec
    echo: Echo
    sequence: int = 0
    output: list[r.OutputItem] = field(default_factory=list)
    open: _Open | None = None
    calls: dict[int, _Open] = field(default_factory=dict)

    def event(self, type: str, **fields: Any) -> bytes:
        e = r.StreamEvent(type=type, sequence_number=self.sequence, **fields)
        self.sequence += 1
        return b"event: " + type.encode() + b"\ndata: " + msgspec.json.encode(e) + b"\n\n"

    def snapshot(
        self, status: Any, finish: str | None = None, usage: r.ResponseUsage | None = None
    ) -> r.Response:
        return _response(self.id, self.created, self.model, self.echo, list(self.output),
                         status=status, finish=finish, usage=usage)  # fmt: skip

    def start(self) -> list[bytes]:
        return [
            self.event("response.created", response=self.snapshot("in_progress")),
            self.event("response.in_progress", response=self.snapshot("in_progress")),
        ]

    def text(self, kind: str, delta: str, logprobs: list[Any] | None = None) -> list[bytes]:
        """Reasoning or answer text (the answer's with its tokens' `logprobs`): opens its item
        (closing another) on the first piece."""
        events: list[bytes] = []
        is_reasoning = kind == "reasoning"
        if self.open is None or isinstance(self.open.item, r.ReasoningItem) != is_reasoning:
            events += self.close()
            item: r.OutputItem = (
                r.ReasoningItem(id=_item_id("rs"), status="in_progress")
                if is_reasoning
                else r.MessageItem(id=_item_id("msg"), status="in_progress", content=[])
            )
            self.open = _Open(len(self.output), item)
            self.output.append(item)
            events.append(self.event("response.output_item.added", output_index=self.open.index, item=item))
            if not is_reasoning:
                events.append(self._part("response.content_part.added", r.OutputText(text="")))
        self.open.text += delta
        self.open.logprobs += logprobs or []
        name = "response.reasoning_text.delta" if is_reasoning else "response.output_text.delta"
        extra: dict[str, Any] = {} if is_reasoning else {"logprobs": logprobs or []}
        events.append(
            self.event(name, item_id=self.open.item.id, output_index=self.open.index, content_index=0,
                       delta=delta, **extra)
        )  # fmt: skip
        return events

    def late_logprobs(self, logprobs: list[Any]) -> list[bytes]:
        """Logprobs of answer text already sent: on the open message (an empty delta carries them),
        else on the last message, closed by a tool call since (they were its last tokens')."""
        if self.open is not None and isinstance(self.open.item, r.MessageItem):
            return self.text("message", "", logprobs)
        last = next(
            (i for i in reversed(range(len(self.output))) if isinstance(self.output[i], r.MessageItem)), None
        )
        if last is not None:
            message = self.output[last]
            assert isinstance(message, r.MessageItem)
            part = message.content[0]
            content = [msgspec.structs.replace(part, logprobs=[*part.logprobs, *logprobs])]
            self.output[last] = msgspec.structs.replace(message, content=content)
        return []

    def _part(self, type: str, part: r.OutputText | r.ReasoningText) -> bytes:
        assert self.open is not None
        return self.event(
            type, item_id=self.open.item.id, output_index=self.open.index, content_index=0, part=part
        )

    def close(self, status: Any = "completed") -> list[bytes]:
        """Finish the open text item: its done events, then `output_item.done`."""
        if self.open is None:
            return []
        opened, self.open = self.open, None
        events: list[bytes] = []
        if isinstance(opened.item, r.ReasoningItem):
            done: r.OutputItem = r.ReasoningItem(
                id=opened.item.id, content=[r.ReasoningText(text=opened.text)]
            )
            events.append(self.event("response.reasoning_text.done", item_id=done.id,
                                     output_index=opened.index, content_index=0, text=opened.text))  # fmt: skip
        else:
            part = r.OutputText(text=opened.text, logprobs=opened.logprobs)
            done = r.MessageItem(id=opened.item.id, status=status, content=[part])
            events.append(self.event("response.output_text.done", item_id=done.id, output_index=opened.index,
                                     content_index=0, text=opened.text, logprobs=opened.logprobs))  # fmt: skip
            self.open = opened
            events.append(self._part("response.content_part.done", part))
            self.open = None
        self.output[opened.index] = done
        events.append(self.event("response.output_item.done", output_index=opened.index, item=done))
        return events

    def call(self, index: int, call_id: str | None, name: str | None, arguments: str) -> list[bytes]:
        """A tool call (the backend sends each whole): added, its arguments, done."""
        events = self.close()
        item = r.FunctionCallItem(
            id=_item_id("fc"), call_id=call_id or f"call_{index}", name=name or "", arguments="",
            status="in_progress",
        )  # fmt: skip
        opened = _Open(len(self.output), item)
        self.output.append(item)
        events.append(self.event("response.output_item.added", output_index=opened.index, item=item))
        events.append(self.event("response.function_call_arguments.delta", item_id=item.id,
                                 output_index=opened.index, delta=arguments))  # fmt: skip
        events.append(self.event("response.function_call_arguments.done", item_id=item.id,
                                 output_index=opened.index, arguments=arguments, name=item.name))  # fmt: skip
        done = msgspec.structs.replace(item, arguments=arguments, status="completed")
        self.output[opened.index] = done
        events.append(self.event("response.output_item.done", output_index=opened.index, item=done))
        return events


async def events_of(stream: Stream, model: ModelSpec, echo: Echo, id: str) -> AsyncIterator[bytes]:
    """The chat chunk stream (one choice, usage included) as Responses events."""
    writer = EventWriter(id, int(time.time()), model, echo)
    for event in writer.start():
        yield event
    finish: str | None = None
    async for frame in stream.frames:
        if not frame.startswith(b"data: {"):
            continue  # [DONE]
        chunk = _frame_decoder.decode(frame[len(b"data: ") :])
        if chunk.error is not None:
            for event in writer.close("incomplete"):
                yield event
            failed = writer.snapshot("failed")
            failed.error = r.ResponseError(
                code=str(chunk.error.get("code")), message=str(chunk.error.get("message"))
            )
            yield writer.event("response.failed", response=failed)
            return
        for choice in chunk.choices:
            delta = choice.delta
            pieces: list[bytes] = []
            if isinstance(delta.reasoning_content, str) and delta.reasoning_content:
                pieces += writer.text("reasoning", delta.reasoning_content)
            logprobs = _logprobs(choice.logprobs)
            if isinstance(delta.content, str) and delta.content:
                pieces += writer.text("message", delta.content, logprobs)
            elif logprobs:  # a token's logprobs may follow its text, in a chunk of their own
                pieces += writer.late_logprobs(logprobs)
            if delta.tool_calls is not UNSET:
                for call in delta.tool_calls:
                    pieces += writer.call(call.index, call.id, call.function.name, call.function.arguments)
            if choice.finish_reason is not None:
                finish = choice.finish_reason
            for event in pieces:
                yield event
        if chunk.usage is not None:
            status = "incomplete" if finish == _FINISHED_AT_LIMIT else "completed"
            for event in writer.close(status):
                yield event
            done = writer.snapshot(status, finish, _usage(chunk.usage, model))
            yield writer.event(f"response.{status}", response=done)

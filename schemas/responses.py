"""OpenAI Responses API wire format (`POST …/ai/v1/responses`), as far as a stateless server serves it.

Policy: as in `schemas.openai`, inputs (`WireIn`) reject unknown fields, outputs (`WireOut`) emit
every field with `None` as `null`. Input items are one Struct with an optional `type` (the `openai`
SDK sends `{"role": …, "content": …}` messages without one), checked per type where they become a
Chat Completions request (`gateway.responses`). Stream events are plain Structs tagged by `type`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from msgspec import UNSET, Meta, UnsetType

from schemas.limits import MaxTokens
from schemas.openai import OpenAITemperature, OpenAITopP, PartText
from schemas.workers_ai import ModelName, NumMessages, NumTools, PromptText, WireIn, WireOut

ItemType = Literal["message", "function_call", "function_call_output", "reasoning"]


# ---- input ------------------------------------------------------------------------------------------
class InputText(WireIn, tag="input_text", tag_field="type", kw_only=True):
    text: PartText


class InputImage(WireIn, tag="input_image", tag_field="type", kw_only=True):
    image_url: Annotated[str, Meta(min_length=1, max_length=28_000_000)] | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] = "auto"


class OutputTextIn(WireIn, tag="output_text", tag_field="type", kw_only=True):
    """An earlier answer's text, sent back in the conversation."""

    text: PartText
    annotations: list[Any] | None = None
    logprobs: list[Any] | None = None


class RefusalIn(WireIn, tag="refusal", tag_field="type", kw_only=True):
    refusal: str


class ReasoningTextIn(WireIn, tag="reasoning_text", tag_field="type", kw_only=True):
    text: PartText


class SummaryTextIn(WireIn, tag="summary_text", tag_field="type", kw_only=True):
    text: PartText


ContentPartIn = InputText | InputImage | OutputTextIn | RefusalIn | ReasoningTextIn


class InputItem(WireIn, kw_only=True):
    """One item of `input`: a message (`role`, `content`), a `function_call` the model made
    (`call_id`, `name`, `arguments`), its `function_call_output` (`call_id`, `output`), or an earlier
    `reasoning` item (`summary` / `content`)."""

    type: ItemType = "message"
    id: str | None = None
    status: str | None = None
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: PartText | Annotated[list[ContentPartIn], Meta(max_length=256)] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: PartText | list[InputText] | None = None
    summary: list[SummaryTextIn] | None = None
    encrypted_content: str | None = None


class FunctionTool(WireIn, kw_only=True):
    type: Literal["function"]
    name: Annotated[str, Meta(min_length=1, max_length=64)]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class NamedFunctionChoice(WireIn, kw_only=True):
    type: Literal["function"]
    name: str


class ReasoningIn(WireIn, kw_only=True):
    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class TextFormat(WireIn, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextIn(WireIn, kw_only=True):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(WireIn, kw_only=True):
    """`POST …/ai/v1/responses`. Nothing is stored: `previous_response_id`, `conversation` and
    `background` are refused; `store` is accepted and answered with `store: false`."""

    model: ModelName | None = None
    input: PromptText | Annotated[list[InputItem], NumMessages] | None = None
    instructions: PromptText | None = None
    tools: Annotated[list[FunctionTool], NumTools] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: MaxTokens | None = None
    max_tool_calls: int | None = None
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    reasoning: ReasoningIn | None = None
    text: TextIn | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    include: list[str] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    top_logprobs: int | None = None
    previous_response_id: str | None = None
    conversation: Any = None
    background: bool | None = None


# ---- output -----------------------------------------------------------------------------------------
class OutputText(WireOut, kw_only=True):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = []
    logprobs: list[Any] = []


class ReasoningText(WireOut, kw_only=True):
    type: Literal["reasoning_text"] = "reasoning_text"
    text: str


class MessageItem(WireOut, tag="message", tag_field="type", kw_only=True):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallItem(WireOut, tag="function_call", tag_field="type", kw_only=True):
    id: str
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"]


class ReasoningItem(WireOut, tag="reasoning", tag_field="type", kw_only=True):
    id: str
    summary: list[Any] = []
    content: list[ReasoningText] = []
    status: Literal["in_progress", "completed", "incomplete"] | None = None


OutputItem = MessageItem | FunctionCallItem | ReasoningItem


class InputTokensDetails(WireOut, kw_only=True):
    cached_tokens: int


class OutputTokensDetails(WireOut, kw_only=True):
    reasoning_tokens: int


class ResponseUsage(WireOut, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int
    neurons: float | UnsetType = UNSET  # Workers AI's price of the call, as on its other usage objects


class IncompleteDetails(WireOut, kw_only=True):
    reason: Literal["max_output_tokens", "content_filter"]


class ResponseError(WireOut, kw_only=True):
    code: str
    message: str


class Response(WireOut, kw_only=True):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None
    max_output_tokens: int | None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: None = None
    reasoning: dict[str, Any]
    store: bool = False
    temperature: float | None
    text: dict[str, Any]
    tool_choice: Any
    tools: list[dict[str, Any]]
    top_p: float | None
    truncation: Literal["disabled"] = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str]


class StreamEvent(WireOut, kw_only=True):
    """One server-sent event; `type` is also the SSE `event:` line."""

    type: str
    sequence_number: int
    response: Response | UnsetType = UNSET
    output_index: int | UnsetType = UNSET
    item: OutputItem | UnsetType = UNSET
    item_id: str | UnsetType = UNSET
    content_index: int | UnsetType = UNSET
    part: OutputText | ReasoningText | UnsetType = UNSET
    delta: str | UnsetType = UNSET
    text: str | UnsetType = UNSET
    arguments: str | UnsetType = UNSET
    name: str | UnsetType = UNSET
    logprobs: list[Any] | UnsetType = UNSET
    code: str | UnsetType = UNSET
    message: str | UnsetType = UNSET

"""OpenAI Chat Completions wire format, as the Workers AI OpenAI-native models take it (§1.3 b, §4).

Policy: inputs (`WireIn`) reject unknown fields; every field the published schema names is
declared here, so normalisation can honour it or refuse it by name. Outputs (`WireOut`) emit every
field, `None` as `null` (OpenAI clients expect `content: null`, `logprobs: null`), except `UNSET`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from schemas.limits import MaxTokens, Penalty, TopLogprobs
from schemas.workers_ai import (
    LegacyFunction,
    ModelName,
    NumMessages,
    NumTools,
    PromptText,
    PromptTokensDetails,
    RunOptions,
    ToolSpec,
    WireIn,
    WireOut,
)

OpenAITemperature = Annotated[float, Meta(ge=0.0, le=2.0)]
OpenAITopP = Annotated[float, Meta(ge=0.0, le=1.0)]
NumChoices = Annotated[int, Meta(ge=1, le=128)]
OpenAISeed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]
StopSeq = Annotated[str, Meta(min_length=1, max_length=256)]
PartText = Annotated[str, Meta(max_length=1_048_576)]


# ---- input: content parts -------------------------------------------------------------------------
class ImageUrl(WireIn, kw_only=True):
    url: Annotated[str, Meta(min_length=1, max_length=28_000_000)]
    detail: Literal["auto", "low", "high"] = "auto"


class TextPartIn(WireIn, tag="text", tag_field="type", kw_only=True):
    text: PartText


class ImagePartIn(WireIn, tag="image_url", tag_field="type", kw_only=True):
    image_url: ImageUrl


class RefusalPartIn(WireIn, tag="refusal", tag_field="type", kw_only=True):
    refusal: str


class VideoPartIn(WireIn, tag="video_url", tag_field="type", kw_only=True):
    video_url: dict[str, Any]


class AudioPartIn(WireIn, tag="input_audio", tag_field="type", kw_only=True):
    input_audio: dict[str, Any]


class FilePartIn(WireIn, tag="file", tag_field="type", kw_only=True):
    file: dict[str, Any]


PartIn = TextPartIn | ImagePartIn | RefusalPartIn | VideoPartIn | AudioPartIn | FilePartIn
Content = PartText | Annotated[list[PartIn], Meta(max_length=256)] | None


# ---- input: messages ---------------------------------------------------------------------------------
class FunctionCallIn(WireIn, kw_only=True):
    name: str
    arguments: str


class ToolCallIn(WireIn, kw_only=True):
    id: str
    type: Literal["function", "custom"] = "function"
    function: FunctionCallIn | None = None
    custom: dict[str, Any] | None = None


class SystemMessage(WireIn, tag="system", tag_field="role", kw_only=True):
    content: Content
    name: str | None = None


class DeveloperMessage(WireIn, tag="developer", tag_field="role", kw_only=True):
    content: Content
    name: str | None = None


class UserMessage(WireIn, tag="user", tag_field="role", kw_only=True):
    content: Content
    name: str | None = None


class AssistantMessage(WireIn, tag="assistant", tag_field="role", kw_only=True):
    content: Content = None
    refusal: str | None = None
    name: str | None = None
    audio: dict[str, Any] | None = None
    tool_calls: list[ToolCallIn] | None = None
    function_call: FunctionCallIn | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None  # Qwen's name for it; accepted on input (§1.3 b)


class ToolMessage(WireIn, tag="tool", tag_field="role", kw_only=True):
    content: Content
    tool_call_id: str


class FunctionMessage(WireIn, tag="function", tag_field="role", kw_only=True):
    content: str | None
    name: str


MessageIn = SystemMessage | DeveloperMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage


# ---- input: the request ------------------------------------------------------------------------------
class JsonSchemaSpec(WireIn, kw_only=True):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFormatIn(WireIn, kw_only=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None


class StreamOptions(WireIn, kw_only=True):
    include_usage: bool = False
    include_obfuscation: bool = False


class ChatTemplateKwargs(WireIn, kw_only=True):
    enable_thinking: bool | None = None
    clear_thinking: bool | None = None


class NamedFunction(WireIn, kw_only=True):
    name: str


class FunctionChoice(WireIn, tag="function", tag_field="type", kw_only=True):
    function: NamedFunction


class CustomChoice(WireIn, tag="custom", tag_field="type", kw_only=True):
    custom: NamedFunction


class AllowedTools(WireIn, kw_only=True):
    mode: Literal["auto", "required"]
    tools: Annotated[list[FunctionChoice | CustomChoice], Meta(min_length=1, max_length=128)]


class AllowedToolsChoice(WireIn, tag="allowed_tools", tag_field="type", kw_only=True):
    allowed_tools: AllowedTools


ToolChoiceIn = Literal["none", "auto", "required"] | FunctionChoice | CustomChoice | AllowedToolsChoice
FunctionCallChoice = Literal["none", "auto"] | NamedFunction  # the deprecated `function_call`


class ChatCompletionRequest(WireIn, kw_only=True):
    """A Chat Completions body (also the OpenAI-native `/ai/run` input, which allows `prompt`)."""

    model: ModelName | None = None
    messages: Annotated[list[MessageIn], NumMessages] | None = None
    prompt: PromptText | None = None
    audio: dict[str, Any] | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: TopLogprobs | None = None
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    metadata: dict[str, str] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    n: NumChoices | None = None
    parallel_tool_calls: bool | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None
    response_format: ResponseFormatIn | None = None
    seed: OpenAISeed | None = None
    service_tier: str | None = None
    stop: StopSeq | Annotated[list[StopSeq], Meta(max_length=4)] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: OpenAITemperature | None = None
    top_p: OpenAITopP | None = None
    tool_choice: ToolChoiceIn | None = None
    tools: Annotated[list[ToolSpec], NumTools] | None = None
    user: str | None = None
    # sent by current OpenAI SDKs when a caller sets them (refused as unknown fields, copied OpenAI
    # code failed with a 400): `prompt_cache_key` routes the requests that share it to one replica
    # (its prefix cache), the others are accepted without effect
    prompt_cache_key: Annotated[str, Meta(max_length=1024)] | None = None
    safety_identifier: str | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    function_call: FunctionCallChoice | None = None
    functions: Annotated[list[LegacyFunction], NumTools] | None = None
    options: RunOptions | None = None


# ---- output ------------------------------------------------------------------------------------------
class FunctionCallOut(WireOut, kw_only=True):
    name: str | None
    arguments: str


class ToolCallOut(WireOut, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class ToolCallChunk(WireOut, kw_only=True):
    index: int
    id: str | None
    type: Literal["function"] = "function"
    function: FunctionCallOut


class TopLogprobOut(WireOut, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobOut(WireOut, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[TopLogprobOut]


class ChoiceLogprobs(WireOut, kw_only=True):
    content: list[TokenLogprobOut] | None
    refusal: None = None


class MessageOut(WireOut, kw_only=True):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCallOut] | UnsetType = UNSET


FinishReasonOut = Literal["stop", "length", "tool_calls", "content_filter", "function_call"]


class Choice(WireOut, kw_only=True):
    index: int
    message: MessageOut
    finish_reason: FinishReasonOut
    logprobs: ChoiceLogprobs | None = None


class CompletionTokensDetails(WireOut, kw_only=True):
    reasoning_tokens: int = 0


class CompletionUsage(WireOut, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = msgspec.field(default_factory=PromptTokensDetails)
    completion_tokens_details: CompletionTokensDetails | UnsetType = UNSET


class ChatCompletion(WireOut, kw_only=True):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage
    system_fingerprint: None = None


class Delta(WireOut, kw_only=True):
    """A chunk's delta: only the keys that carry something are sent."""

    role: Literal["assistant"] | UnsetType = UNSET
    content: str | None | UnsetType = UNSET
    reasoning_content: str | None | UnsetType = UNSET
    tool_calls: list[ToolCallChunk] | UnsetType = UNSET


class ChunkChoice(WireOut, kw_only=True):
    index: int
    delta: Delta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(WireOut, kw_only=True):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None | UnsetType = UNSET
    system_fingerprint: None = None
    p: str | UnsetType = UNSET


class ModelOut(WireOut, kw_only=True):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    # beyond OpenAI's object (its SDKs keep unknown fields): the tokens a request may hold, input and
    # output together, as the catalog's `context_window` says (what a replica admits)
    context_window: int | UnsetType = UNSET


class ModelList(WireOut, kw_only=True):
    object: Literal["list"] = "list"
    data: list[ModelOut]

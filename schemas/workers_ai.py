"""Workers AI wire format: the v4 envelope, the legacy text-generation input/output, stream frames.

Policy (set once on `WireIn` / `WireOut`): inputs reject unknown fields, so a 400 names the field
we do not serve; outputs always emit every declared field (the envelope's `success`, `errors`,
`messages` and `result` are always present) except those left `UNSET`, which are omitted.
Reference: shared/reference/workers-ai-api.md §1.2–1.5 and §6.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from schemas.limits import DEFAULT_MAX_TOKENS, MaxTokens, Penalty

# ---- named limits -------------------------------------------------------------------------------------
PromptText = Annotated[str, Meta(min_length=1, max_length=1_048_576)]
MessageText = Annotated[str, Meta(max_length=1_048_576)]
LegacyTemperature = Annotated[float, Meta(ge=0.0, le=5.0)]
LegacyTopP = Annotated[float, Meta(ge=0.001, le=1.0)]
LegacyTopK = Annotated[int, Meta(ge=1, le=50)]
LegacySeed = Annotated[int, Meta(ge=1, le=9_999_999_999)]
LegacyRepetitionPenalty = Annotated[float, Meta(gt=0.0, le=2.0)]
NumMessages = Meta(min_length=1, max_length=1024)
NumTools = Meta(max_length=128)
ImageBytes = Annotated[list[Annotated[int, Meta(ge=0, le=255)]], Meta(max_length=20_000_000)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]


class WireIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Public input: unknown fields rejected (the 400 names them)."""


class WireOut(msgspec.Struct, omit_defaults=False, kw_only=True):
    """Public output: every field emitted, `UNSET` ones left out."""


# ---- envelope -----------------------------------------------------------------------------------------
class ErrorItem(WireOut, kw_only=True):
    code: int
    message: str


class Envelope(WireOut, kw_only=True):
    """The Cloudflare v4 envelope; all four keys are always sent (§1.2)."""

    result: Any
    success: bool
    errors: list[ErrorItem] = msgspec.field(default_factory=list)
    messages: list[Any] = msgspec.field(default_factory=list)


class ResultInfo(WireOut, kw_only=True):
    page: int
    per_page: int
    count: int
    total_count: int


class PagedEnvelope(Envelope, kw_only=True):
    result_info: ResultInfo | UnsetType = UNSET


# ---- legacy input (§1.3 a) ------------------------------------------------------------------------------
class LegacyFunction(WireIn, kw_only=True):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    strict: bool | None = None


class ToolSpec(WireIn, kw_only=True):
    """Either shape the Workers AI `tools` schema accepts: flat `{name, description, parameters}`
    or OpenAI's `{type: "function", function: {...}}` (and OpenAI's `custom`, refused later)."""

    type: str | None = None
    function: LegacyFunction | None = None
    custom: dict[str, Any] | None = None
    name: str | None = None
    description: str = ""
    parameters: dict[str, Any] | None = None


class LegacyMessage(WireIn, kw_only=True):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: MessageText | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    name: str | None = None


class LegacyResponseFormat(WireIn, kw_only=True):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None


class RunOptions(WireIn, kw_only=True):
    rejectIfBusy: bool = False


class LegacyInput(WireIn, kw_only=True):
    """Input of a legacy-family text-generation model (prompt or messages)."""

    prompt: PromptText | None = None
    messages: Annotated[list[LegacyMessage], NumMessages] | None = None
    image: ImageBytes | str | None = None
    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    temperature: LegacyTemperature = 0.6
    top_p: LegacyTopP | None = None
    top_k: LegacyTopK | None = None
    seed: LegacySeed | None = None
    repetition_penalty: LegacyRepetitionPenalty | None = None
    frequency_penalty: Penalty | None = None
    presence_penalty: Penalty | None = None
    stream: bool = False
    raw: bool = False
    lora: str | None = None
    response_format: LegacyResponseFormat | None = None
    guided_json: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    tools: Annotated[list[ToolSpec], NumTools] | None = None
    options: RunOptions | None = None


class RunEnvelopeInput(WireIn, kw_only=True):
    """`POST …/ai/run` without a model in the path: `{model, input}` (§1.1)."""

    model: ModelName
    input: msgspec.Raw
    options: RunOptions | None = None


# ---- legacy output (§1.3 a, §1.5) -----------------------------------------------------------------------
class PromptTokensDetails(WireOut, kw_only=True):
    cached_tokens: int = 0


class LegacyUsage(WireOut, kw_only=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | UnsetType = UNSET
    neurons: float | UnsetType = UNSET


class LegacyToolCall(WireOut, kw_only=True):
    """A legacy tool call: `arguments` is an object, no `id`, no `type`."""

    name: str
    arguments: Any


class LegacyResult(WireOut, kw_only=True):
    response: Any  # text, or the parsed object in JSON mode
    tool_calls: list[LegacyToolCall] | UnsetType = UNSET
    usage: LegacyUsage


class LegacyFrame(WireOut, kw_only=True):
    """One legacy SSE frame: `p` is random padding against the token-length side channel."""

    response: str
    p: str | UnsetType = UNSET
    tool_calls: list[LegacyToolCall] | UnsetType = UNSET
    usage: LegacyUsage | UnsetType = UNSET


class Trailer(WireOut, kw_only=True):
    """The Workers AI usage trailer after OpenAI chunks on `/ai/run` (§1.5)."""

    response: str
    usage: LegacyUsage

"""The gateway ↔ backend internal protocol and the engine's request/event Structs.

Policy (set once on `Base`): unknown fields are rejected, defaults are omitted on the wire,
fields are keyword-only. Everything here is plain data; nothing imports torch.

Wire (DESIGN.md §3):
- `POST /v1/generate`: body `GenerateRequest`, response NDJSON, one `Event` per line.
- `GET /v1/load`: `LoadReport`.  `GET /v1/model`: `ModelCard`.  `GET /v1/health`: `Health`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.limits import DEFAULT_MAX_TOKENS, MaxTokens, Penalty, TopLogprobs

# ---- named limits (validated once, at the edge) --------------------------------------------------
Temperature = Annotated[float, Meta(ge=0.0, le=5.0)]
TopP = Annotated[float, Meta(gt=0.0, le=1.0)]
TopK = Annotated[int, Meta(ge=0, le=10_000)]
RepetitionPenalty = Annotated[float, Meta(gt=0.0, le=10.0)]
Seed = Annotated[int, Meta(ge=0, le=2**63 - 1)]
StopList = Annotated[list[Annotated[str, Meta(min_length=1, max_length=256)]], Meta(max_length=16)]
Priority = Annotated[int, Meta(ge=0, le=10)]
TenantSalt = Annotated[str, Meta(pattern=r"^[0-9a-f]{16,128}$")]
RequestId = Annotated[str, Meta(min_length=1, max_length=128)]


MAX_RANKS = 64  # the most `--tp`, `--ep` and `--dcp` ranks a backend takes (kumo serve checks it too)
MAX_DRAFT_TOKENS = 3  # the most tokens `--speculative mtp:K` drafts per step (kumo serve checks it too)
_SPECULATIVE = re.compile(r"^mtp:([1-9]\d*)$")


def parse_speculative(text: str | None) -> int:
    """`--speculative`: `mtp:K` → K draft tokens (1 … MAX_DRAFT_TOKENS); None, "" or "off" → 0."""
    if text is None or text in ("", "off"):
        return 0
    match = _SPECULATIVE.match(text)
    if match is None or not 1 <= int(match.group(1)) <= MAX_DRAFT_TOKENS:
        raise ValueError(f"--speculative takes mtp:K with K in 1..{MAX_DRAFT_TOKENS} (or off), got {text!r}")
    return int(match.group(1))


class Base(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True, kw_only=True):
    """Internal-protocol base: unknown fields rejected, defaults omitted, keyword-only."""


# ---- request ----------------------------------------------------------------------------------------
class TextPart(Base, tag="text", tag_field="type"):
    text: str


class ImagePart(Base, tag="image", tag_field="type"):
    """Image bytes (base64 in JSON). The gateway fetched and checked them; the backend decodes them."""

    data: bytes
    media_type: str = "image/png"


ContentPart = TextPart | ImagePart


class ToolCallFunction(Base):
    name: str
    arguments: str  # JSON text of the arguments object


class ToolCall(Base):
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class Message(Base):
    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None


class Tool(Base):
    name: str
    description: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)  # a JSON Schema


class ToolChoice(Base):
    """`auto` (model decides), `none` (no tools), `required` (some tool), `function` (the named one)."""

    mode: Literal["auto", "none", "required", "function"] = "auto"
    name: str | None = None


class Reasoning(Base):
    """Reasoning switches; None means the model's default. Handed to the chat template as it expects."""

    enabled: bool | None = None
    effort: Literal["low", "medium", "high", "max"] | None = None  # "max": GLM 5.x's top level


class ResponseFormat(Base):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: dict[str, Any] | None = None  # the schema itself, when type is json_schema


class SamplingParams(Base):
    """Sampling for one request. temperature 0 means greedy."""

    max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0  # 0 = off
    repetition_penalty: RepetitionPenalty = 1.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    seed: Seed | None = None
    stop: StopList = msgspec.field(default_factory=list)
    stop_token_ids: list[int] = msgspec.field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: TopLogprobs = 0
    prompt_logprobs: bool = False


class GenerateRequest(Base):
    """What the gateway sends to `POST /v1/generate` (DESIGN.md §2 step 2 → 4).

    Either `messages` (rendered with the checkpoint's chat template) or `prompt` with `raw` true
    (tokenized as is). `tenant_salt` is derived by the gateway from the tenant id, never by a client.
    """

    request_id: RequestId
    tenant_salt: TenantSalt
    messages: list[Message] | None = None
    prompt: str | None = None
    raw: bool = False
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool = True
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    reasoning: Reasoning = msgspec.field(default_factory=Reasoning)
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reject_if_busy: bool = False
    priority: Priority = 0  # 0 interactive; higher runs later (async batch)


# ---- events (NDJSON lines) --------------------------------------------------------------------------
class TopLogprob(Base):
    """`token` is the token's text decoded alone (U+FFFD where it holds part of a character);
    `token_bytes` its own bytes (base64 in JSON), which joined over consecutive tokens give the text."""

    token: str
    token_id: int
    logprob: float
    token_bytes: bytes | None = None  # None: not filled (an older backend); the gateway encodes `token`


class TokenLogprob(Base):
    """A sampled (or prompt) token's log-prob and the best alternatives; fields as in `TopLogprob`."""

    token: str
    token_id: int
    logprob: float
    top: list[TopLogprob] = msgspec.field(default_factory=list)
    token_bytes: bytes | None = None


class TextDelta(Base, tag="text", tag_field="type"):
    text: str
    # the logprobs of the answer's tokens this delta's output brought (reasoning, markers, special
    # tokens and parsed tool calls have none: backend/text/output_processor.py), possibly with "" text
    logprobs: list[TokenLogprob] | None = None


class ReasoningDelta(Base, tag="reasoning", tag_field="type"):
    text: str


class ToolCallDelta(Base, tag="tool_call", tag_field="type"):
    """A piece of tool call `index`. The first piece carries `id` and the whole `name`; later pieces
    append to `arguments` (JSON text). A name is never split across pieces."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


class Started(Base, tag="started", tag_field="type"):
    """A request's first event: its prompt is in, counted as its `Usage` will count it. A choice cut
    before its usage came is billed this prompt (not the gateway's estimate from the body's size)."""

    prompt_tokens: int
    cached_tokens: int = 0


class Usage(Base, tag="usage", tag_field="type"):
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0
    reasoning_tokens: int = 0  # of the completion tokens, those inside the reasoning block (markers aside)
    prompt_logprobs: list[TokenLogprob | None] | None = None


FinishReason = Literal["stop", "length", "tool_calls", "abort"]


class Finish(Base, tag="finish", tag_field="type"):
    reason: FinishReason


ErrorCode = Literal[
    "invalid_request",  # 400
    "unauthorized",  # 401
    "context_window_exceeded",  # 413 / Workers AI 5021
    "too_large_for_pool",  # 413
    "busy",  # 429 / Workers AI 3040
    "integrity_abort",  # 500: a KV page tag mismatch aborted the request
    "aborted",  # 499/3008: the request was ended before it finished
    "timeout",  # 408/3046
    "unsupported",  # 400: asked for something this model cannot do (images without vision, …)
    "internal",  # 500
]


class Error(Base, tag="error", tag_field="type"):
    code: ErrorCode
    message: str
    status: int = 500


Event = Started | TextDelta | ReasoningDelta | ToolCallDelta | Usage | Finish | Error


class ErrorBody(Base):
    """Non-streaming 4xx/5xx body of the backend (before any event was sent)."""

    error: Error


# ---- introspection ----------------------------------------------------------------------------------
class Capabilities(Base):
    vision: bool = False
    tools: bool = True
    reasoning: bool = True
    json_mode: bool = True


class ModelCard(Base):
    """`GET /v1/model`: what this replica actually serves; the catalog checks it."""

    name: str
    architecture: str  # config.json `architectures[0]`
    family: Literal["kimi", "glm"]
    weights: str  # "float32" | "bfloat16" | "fp8" | "int4-w4a16" | …
    kv_dtype: str  # "float32" | "bfloat16" | "fp8_e4m3"
    context_window: int
    page_size: int  # tokens of a sequence per page (under DCP, each rank holds page_size / dcp of them)
    num_pages: int  # pages in the pool, as `/v1/load`'s total_pages
    capabilities: Capabilities = msgspec.field(default_factory=Capabilities)
    tp: int = 1  # tensor-parallel ranks, one process per device
    ep: int = 1  # expert-parallel groups
    dcp: int = 1  # ranks sharing one MLA latent cache by token
    startup_s: float | None = None  # start to ready: checkpoint load, CUDA graphs, warm-up
    warmup_s: float | None = None  # of which the warm-up ran every step shape (`backend.server.warmup`)

    @property
    def max_request_tokens(self) -> int:
        """The most tokens (input + max output) one request may ask for: the model's window, or
        less when the page pool (`/v1/load`'s `total_pages` of `page_size`) is smaller."""
        return min(self.context_window, self.num_pages * self.page_size)


class LoadReport(Base):
    """`GET /v1/load`: what the router needs to pick a replica."""

    waiting: int
    running: int
    free_pages: int
    total_pages: int


class Health(Base):
    status: Literal["ok", "starting", "draining", "failed"]  # failed: the engine thread died


# ---- engine level (token ids; the serving layer sits above) -----------------------------------------
class ImageSpan(Base):
    """Placeholder tokens [offset, offset+length) of the prompt whose embeddings come from an image."""

    offset: int
    length: int
    image_hash: str  # hex SHA-256 over the image bytes and its shape; part of the prefix-cache key


class ReasoningMarkers(Base):
    """The reasoning block's marker ids, for the engine's reasoning guard: while the block is open
    the request's `eos_token_ids` are masked, so the model closes it before it ends its turn.
    `is_open`: the prompt leaves the block open (the template opened it). `call_start_id`: the
    family's tool-call opening marker when tools are offered: a call ends the block, as the reasoning
    parser reads it (backend/text/reasoning.py)."""

    start_id: int
    end_id: int
    is_open: bool = False
    call_start_id: int | None = None


class EngineRequest(Base):
    """One sequence for the engine: prompt token ids and how to sample the rest. `reasoning_markers`
    is set when the request reasons freely (reasoning on, no grammar); `banned_token_ids` are never
    sampled (the family's tool-call markers in a chat where no tool may be called)."""

    request_id: RequestId
    prompt_token_ids: list[int]
    tenant_salt: TenantSalt
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    image_spans: list[ImageSpan] = msgspec.field(default_factory=list)
    eos_token_ids: list[int] = msgspec.field(default_factory=list)
    reasoning_markers: ReasoningMarkers | None = None
    banned_token_ids: list[int] = msgspec.field(default_factory=list)
    reject_if_busy: bool = False
    priority: Priority = 0


class EngineOutput(Base):
    """What the engine yields for a request after a step: the new tokens, and at the end a finish
    reason or an error. `num_cached_tokens` counts prompt tokens served from the prefix cache."""

    request_id: str
    token_ids: list[int] = msgspec.field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob | None] | None = None
    finish_reason: FinishReason | None = None
    error: Error | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    num_output_tokens: int = 0

"""The model catalog: the TOML file's entries (what Kumo serves, and from which pool) and the
Workers AI catalog objects rendered from them (§3).

Policy: file Structs (`FileBase`) reject unknown keys, so a typo in a catalog file fails at start
instead of silently dropping a setting; wire Structs (`WireOut`) emit every field.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from schemas.limits import DEFAULT_MAX_TOKENS, MaxTokens
from schemas.workers_ai import WireOut

Uuid = Annotated[str, Meta(pattern=r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")]
CreatedAt = Annotated[str, Meta(pattern=r"^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}$")]
EffortLevel = Literal["none", "low", "medium", "high", "max"]


class FileBase(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Catalog/pools file policy: unknown keys are errors."""


class Price(FileBase, kw_only=True):
    unit: str
    price: float
    currency: str = "USD"


class TaskSpec(FileBase, kw_only=True):
    id: Uuid
    name: str
    description: str


class ReasoningEffortSpec(FileBase, kw_only=True):
    """Per-model `reasoning_effort` (§5): the levels it serves, its default, and aliases onto them."""

    levels: list[EffortLevel]
    default: EffortLevel
    aliases: dict[str, EffortLevel] = msgspec.field(default_factory=dict)
    can_disable: bool = True


class ModelSpec(FileBase, kw_only=True):
    """One catalog entry and how it is served.

    `family` picks the input/output format: `openai` (Kimi/GLM: Chat Completions bodies) or
    `legacy` (Workers AI's `prompt`/`messages` → `response`). `architecture` is what the pool's
    backend must report in `/v1/model`, else the pool is not served.
    """

    id: Uuid
    name: str
    source: int = 1
    description: str
    task: str = "Text Generation"
    created_at: CreatedAt
    tags: list[str] = msgspec.field(default_factory=list)
    aliases: list[str] = msgspec.field(default_factory=list)  # retired ids served by this entry
    pool: str
    family: Literal["openai", "legacy"] = "openai"
    architecture: str
    author: str
    experimental: bool = False
    require_workers_paid: bool = False
    vision: bool = False
    function_calling: bool = True
    reasoning: bool = True
    default_max_tokens: MaxTokens = DEFAULT_MAX_TOKENS
    reasoning_effort: ReasoningEffortSpec | None = None
    properties: dict[str, str] = msgspec.field(default_factory=dict)  # extra string properties (terms, info…)
    price: list[Price] = msgspec.field(default_factory=list)


class AuthorSpec(FileBase, kw_only=True):
    name: str
    description: str = ""


class CatalogFile(FileBase, kw_only=True):
    tasks: list[TaskSpec]
    authors: list[AuthorSpec] = msgspec.field(default_factory=list)
    models: list[ModelSpec]


class PoolSpec(FileBase, kw_only=True):
    """A pool: replicas serving one model, and the shared secret they require."""

    replicas: Annotated[list[str], Meta(min_length=1)]
    secret: str


class PoolsFile(FileBase, kw_only=True):
    pools: dict[str, PoolSpec]


# ---- wire (GET …/ai/models/search, tasks, authors) ----------------------------------------------------
class TaskOut(WireOut, kw_only=True):
    id: str
    name: str
    description: str


class PropertyOut(WireOut, kw_only=True):
    property_id: str
    value: Any  # a string, except `price` (a list) and `reasoning_effort` (an object)


class ModelObject(WireOut, kw_only=True):
    id: str
    source: int
    name: str
    description: str
    task: TaskOut
    created_at: str
    tags: list[str]
    properties: list[PropertyOut]


class AuthorOut(WireOut, kw_only=True):
    name: str
    description: str


class SchemaOut(WireOut, kw_only=True):
    input: dict[str, Any]
    output: dict[str, Any]


class Account(WireOut, kw_only=True):
    id: str
    name: str


class Membership(WireOut, kw_only=True):
    id: str
    account: Account
    status: str = "accepted"
    permissions: list[str] = msgspec.field(default_factory=lambda: ["Workers AI Write"])

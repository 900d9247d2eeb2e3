"""Tenant admin API bodies (`/admin/v1/...`) and the usage ledger's record.

Policy: request bodies (`AdminIn`) reject unknown fields, so a body that tries to set `id`,
`created_at` or anything else we do not let an admin assign is a 400 naming the field (OWASP API3,
mass assignment). Responses (`AdminOut`) emit every field, nulls included: `null` means
"unlimited" in quotas and "every model" in allow-lists, so it must be visible.
Timestamps are UTC, encoded as RFC 3339 with `Z`.
"""

from __future__ import annotations

import datetime as dt
from typing import Annotated, Literal

import msgspec
from msgspec import Meta

# ---- named limits -------------------------------------------------------------------------------------
TenantId = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
TokenId = Annotated[str, Meta(pattern=r"^[0-9a-f]{32}$")]
# no control characters: a NUL cannot be stored by PostgreSQL, a newline forges log and CLI lines
Name = Annotated[str, Meta(min_length=1, max_length=200, pattern=r"^[^\x00-\x1f\x7f]*$")]
Plan = Literal["free", "paid"]
PerMinute = Annotated[int, Meta(ge=0, le=100_000_000)]
DailyNeurons = Annotated[float, Meta(ge=0, le=1e15)]
ModelName = Annotated[str, Meta(min_length=1, max_length=256)]
ModelAllowList = Annotated[list[ModelName], Meta(max_length=10_000)]
Page = Annotated[int, Meta(ge=1, le=1_000_000)]
PerPage = Annotated[int, Meta(ge=1, le=1000)]
TokenCount = Annotated[int, Meta(ge=0)]
# RFC 3339 with its offset (msgspec states neither the format nor the offset in the schema on its own)
Expiry = Annotated[dt.datetime, Meta(tz=True, extra_json_schema={"format": "date-time"})]

FREE_DAILY_NEURONS = 10_000.0  # Workers AI's daily allocation on the Free plan (reference §8)


class AdminIn(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Admin request body: unknown fields rejected."""


class AdminOut(msgspec.Struct, omit_defaults=False, kw_only=True):
    """Admin response body: every field emitted, nulls included."""


# ---- quotas and models ----------------------------------------------------------------------------
class Quotas(AdminOut):
    """Per-tenant limits; `None` is unlimited. Also the body of `PUT .../quotas`, where all three
    keys are required (a forgotten key must not silently lift a limit)."""

    requests_per_minute: PerMinute | None = None
    tokens_per_minute: PerMinute | None = None
    daily_neurons: DailyNeurons | None = None

    @classmethod
    def for_plan(cls, plan: Plan) -> Quotas:
        return cls(daily_neurons=FREE_DAILY_NEURONS if plan == "free" else None)


class QuotasIn(AdminIn):
    requests_per_minute: PerMinute | None
    tokens_per_minute: PerMinute | None
    daily_neurons: DailyNeurons | None


class QuotasPatch(AdminIn):
    """`PATCH .../quotas`: the keys given change (null = unlimited), the others stay."""

    requests_per_minute: PerMinute | None | msgspec.UnsetType = msgspec.UNSET
    tokens_per_minute: PerMinute | None | msgspec.UnsetType = msgspec.UNSET
    daily_neurons: DailyNeurons | None | msgspec.UnsetType = msgspec.UNSET

    def applied_to(self, quotas: Quotas) -> Quotas:
        changes = {f: v for f in self.__struct_fields__ if (v := getattr(self, f)) is not msgspec.UNSET}
        return msgspec.structs.replace(quotas, **changes)


class ModelsIn(AdminIn):
    allow: ModelAllowList | None


class Models(AdminOut):
    allow: list[str] | None = None


# ---- tenants ------------------------------------------------------------------------------------------
class TenantCreate(AdminIn):
    name: Name
    plan: Plan = "free"


class TenantPatch(AdminIn):
    """Changing the plan resets `daily_neurons` to the new plan's default. `suspended`: true
    refuses the tenant's tokens (403) and holds its queued batch jobs; false resumes both."""

    name: Name | None = None
    plan: Plan | None = None
    suspended: bool | None = None


class Tenant(AdminOut):
    id: str
    name: str
    plan: Plan
    created_at: dt.datetime
    quotas: Quotas
    models: Models
    suspended_at: dt.datetime | None = None  # null: active


# ---- tokens -------------------------------------------------------------------------------------------
class TokenCreate(AdminIn):
    name: Name
    expires_at: Expiry | None = None


class TokenCreated(AdminOut):
    """The only response that carries the token's value; the store keeps its SHA-256 alone."""

    id: str
    name: str
    value: str
    created_at: dt.datetime
    expires_at: dt.datetime | None = None


class Token(AdminOut):
    id: str
    name: str
    created_at: dt.datetime
    expires_at: dt.datetime | None = None
    last_used_at: dt.datetime | None = None
    revoked_at: dt.datetime | None = None


# ---- usage --------------------------------------------------------------------------------------------
class UsageRecord(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One served request, as the ledger stores it (written after the response, DESIGN.md §2 step 8)."""

    tenant_id: TenantId
    model: ModelName
    request_id: Annotated[str, Meta(min_length=1, max_length=128)]
    prompt_tokens: TokenCount = 0
    cached_tokens: TokenCount = 0
    completion_tokens: TokenCount = 0
    neurons: Annotated[float, Meta(ge=0)] = 0.0
    status: Annotated[int, Meta(ge=100, le=599)] = 200
    at: dt.datetime = msgspec.field(default_factory=lambda: dt.datetime.now(dt.UTC))


class UsageGroup(AdminOut):
    """One group of `GET .../usage`: `day` (YYYY-MM-DD) or `model`, whichever was grouped by.
    `requests` counts every request admitted past the rate limits, `failed_requests` those of them
    that ended in an error (a backend's refusal, a cut stream: billed what they computed, often
    nothing); a request refused before admission (a malformed body, a 429) is not counted."""

    day: str | None = None
    model: str | None = None
    requests: int = 0
    failed_requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    neurons: float = 0.0


# ---- audit --------------------------------------------------------------------------------------------
class AuditEntry(AdminOut):
    """One admin mutation: who, when, what, on which object; `detail` never holds a token value."""

    id: int
    at: dt.datetime
    actor: str
    request_id: str | None  # the admin request's id (x-request-id), to join with the access log
    action: str
    tenant_id: str | None
    object_id: str | None
    detail: dict[str, object]

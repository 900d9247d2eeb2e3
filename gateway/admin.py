"""The tenant admin API, mounted under `/admin/v1` (issue 4 item 4).

Every route first checks the admin token (401 without a valid one, 403 for a tenant's token),
then decodes its body with a typed decoder that rejects unknown fields, then acts through the
store, which writes the audit entry in the same transaction. Bodies travel in the v4 envelope;
unknown ids are 404; errors propagate to the app's one handler (`gateway.app.render_error`). A revocation, deletion or quota change also drops this replica's cached
tenant at once; other replicas notice within the authenticator's cache window.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol, TypeVar

import msgspec
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.auth import Authenticator
from gateway.body import decode_json
from gateway.catalog import Catalog
from gateway.errors import InvalidAdminRequest, NotFound, UnknownModel
from gateway.observability import info_of
from gateway.store import Store
from schemas.admin import ModelsIn, Quotas, QuotasIn, QuotasPatch, TenantCreate, TenantPatch, TokenCreate
from schemas.workers_ai import Envelope, PagedEnvelope, ResultInfo

T = TypeVar("T")
Handler = Callable[[Request, str], Awaitable[Envelope]]
DATE = re.compile(r"^\d{4}-\d{2}-\d{2}$")
ID = re.compile(r"^[0-9a-f]{32}$")
MAX_PER_PAGE = 1000
MAX_USAGE_DAYS = 3660
MAX_BODY_BYTES = 4 * 1024 * 1024  # a 10,000-model allow-list fits


class AdminServices(Protocol):
    """What the admin routes need from the app's `Services`."""

    store: Store
    authenticator: Authenticator
    catalog: Catalog


TENANT_CREATE = msgspec.json.Decoder(TenantCreate)
TENANT_PATCH = msgspec.json.Decoder(TenantPatch)
TOKEN_CREATE = msgspec.json.Decoder(TokenCreate)
QUOTAS = msgspec.json.Decoder(QuotasIn)
QUOTAS_PATCH = msgspec.json.Decoder(QuotasPatch)
MODELS = msgspec.json.Decoder(ModelsIn)


async def _body(request: Request, decoder: msgspec.json.Decoder[T]) -> T:
    """The body decoded; read in chunks and refused as soon as it passes `MAX_BODY_BYTES`."""
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > MAX_BODY_BYTES:
            raise InvalidAdminRequest(f"Request body is larger than {MAX_BODY_BYTES} bytes")
    if not raw.strip():
        raise InvalidAdminRequest("Request body is missing")
    try:
        return decode_json(bytes(raw), decoder)
    except msgspec.ValidationError as exc:
        raise InvalidAdminRequest(f"Invalid request body: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise InvalidAdminRequest(f"Malformed JSON in request body: {exc}") from exc
    except RecursionError as exc:
        raise InvalidAdminRequest("Malformed JSON in request body: nested too deeply") from exc


def _int_query(request: Request, name: str, default: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 18) or not 1 <= int(raw) <= high:
        raise InvalidAdminRequest(f"Query parameter {name} must be an integer from 1 to {high}")
    return int(raw)


def _date_query(request: Request, name: str) -> dt.date | None:
    raw = request.query_params.get(name)
    if raw is None:
        return None
    try:
        if not DATE.match(raw):
            raise ValueError(raw)
        return dt.date.fromisoformat(raw)
    except ValueError as exc:
        raise InvalidAdminRequest(f"Query parameter {name} must be a date YYYY-MM-DD") from exc


def _id(request: Request, name: str) -> str:
    value = str(request.path_params[name])
    if not ID.match(value):
        raise NotFound(f"No {name.removesuffix('_id')} {value}")
    return value


def _request_id(request: Request) -> str:
    return info_of(request.scope).request_id


def _ok(result: Any) -> Envelope:
    return Envelope(result=result, success=True)


def _paged(items: list[Any], total: int, page: int, per_page: int) -> PagedEnvelope:
    info = ResultInfo(page=page, per_page=per_page, count=len(items), total_count=total)
    return PagedEnvelope(result=items, success=True, result_info=info)


def _json(envelope: Envelope) -> Response:
    return Response(msgspec.json.encode(envelope), media_type="application/json")


class AdminApi:
    """The admin routes' handlers, bound to the app's services."""

    def __init__(self, services: AdminServices) -> None:
        self.services = services

    @property
    def store(self) -> Store:
        return self.services.store

    def endpoint(self, handler: Handler) -> Callable[[Request], Awaitable[Response]]:
        async def run(request: Request) -> Response:
            actor = await self.services.authenticator.authenticate_admin(request.headers.get("authorization"))
            return _json(await handler(request, actor))

        return run

    # ---- tenants ------------------------------------------------------------------------------------
    async def create_tenant(self, request: Request, actor: str) -> Envelope:
        return _ok(
            await self.store.create_tenant(
                await _body(request, TENANT_CREATE), actor=actor, request_id=_request_id(request)
            )
        )

    async def list_tenants(self, request: Request, actor: str) -> Envelope:
        page = _int_query(request, "page", 1, 1_000_000)
        per_page = _int_query(request, "per_page", 50, MAX_PER_PAGE)
        tenants, total = await self.store.list_tenants(page=page, per_page=per_page)
        return _paged(tenants, total, page, per_page)

    async def get_tenant(self, request: Request, actor: str) -> Envelope:
        return _ok(await self.store.get_tenant(_id(request, "tenant_id")))

    async def update_tenant(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        tenant = await self.store.update_tenant(
            tenant_id, await _body(request, TENANT_PATCH), actor=actor, request_id=_request_id(request)
        )
        self.services.authenticator.forget(tenant_id=tenant_id)
        return _ok(tenant)

    async def delete_tenant(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        await self.store.delete_tenant(tenant_id, actor=actor, request_id=_request_id(request))
        self.services.authenticator.forget(tenant_id=tenant_id)
        return _ok({"id": tenant_id})

    async def set_quotas(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        body = await _body(request, QUOTAS)
        quotas = Quotas(
            requests_per_minute=body.requests_per_minute,
            tokens_per_minute=body.tokens_per_minute,
            daily_neurons=body.daily_neurons,
        )
        tenant = await self.store.set_quotas(tenant_id, quotas, actor=actor, request_id=_request_id(request))
        self.services.authenticator.forget(tenant_id=tenant_id)
        return _ok(tenant.quotas)

    async def patch_quotas(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        body = await _body(request, QUOTAS_PATCH)
        tenant = await self.store.set_quotas(tenant_id, body, actor=actor, request_id=_request_id(request))
        self.services.authenticator.forget(tenant_id=tenant_id)
        return _ok(tenant.quotas)

    async def set_models(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        allow = (await _body(request, MODELS)).allow
        if allow is not None:
            allow = [self._model_id(name, f"allow[{i}]") for i, name in enumerate(allow)]
        tenant = await self.store.set_models(tenant_id, allow, actor=actor, request_id=_request_id(request))
        self.services.authenticator.forget(tenant_id=tenant_id)
        return _ok(tenant.models)

    def _model_id(self, name: str, field: str) -> str:
        """A catalog model's id for an allow-list entry (its id or an alias, which requests are
        served under the id of: an alias kept as written would never match). An unknown name is
        refused: a typo would deny the tenant the model it was meant to allow."""
        try:
            return self.services.catalog.get(name).name
        except UnknownModel:
            raise InvalidAdminRequest(f"{field}: no model {name!r} in the catalog") from None

    # ---- tokens -------------------------------------------------------------------------------------
    async def create_token(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        body = await _body(request, TOKEN_CREATE)
        # its time zone is required by the decoder (`Expiry`)
        if body.expires_at is not None and body.expires_at <= dt.datetime.now(dt.UTC):
            raise InvalidAdminRequest("expires_at is in the past")
        return _ok(
            await self.store.create_token(tenant_id, body, actor=actor, request_id=_request_id(request))
        )

    async def list_tokens(self, request: Request, actor: str) -> Envelope:
        return _ok(await self.store.list_tokens(_id(request, "tenant_id")))

    async def revoke_token(self, request: Request, actor: str) -> Envelope:
        tenant_id, token_id = _id(request, "tenant_id"), _id(request, "token_id")
        token = await self.store.revoke_token(
            tenant_id, token_id, actor=actor, request_id=_request_id(request)
        )
        self.services.authenticator.forget(token_id=token_id)
        return _ok(token)

    # ---- usage and audit ----------------------------------------------------------------------------
    async def usage(self, request: Request, actor: str) -> Envelope:
        tenant_id = _id(request, "tenant_id")
        until = _date_query(request, "until") or dt.datetime.now(dt.UTC).date()
        # default: the 30 days up to `until` (from the calendar's first day, for the earliest)
        since = _date_query(request, "since") or until - dt.timedelta(
            days=min(29, (until - dt.date.min).days)
        )
        if since > until or (until - since).days > MAX_USAGE_DAYS:
            raise InvalidAdminRequest(
                f"since must not be after until, nor more than {MAX_USAGE_DAYS} days before it"
            )
        group_by = request.query_params.get("group_by", "day")
        if group_by not in ("day", "model"):
            raise InvalidAdminRequest("group_by must be day or model")
        by: Literal["day", "model"] = "day" if group_by == "day" else "model"
        return _ok(await self.store.usage(tenant_id, since=since, until=until, group_by=by))

    async def audit(self, request: Request, actor: str) -> Envelope:
        page = _int_query(request, "page", 1, 1_000_000)
        per_page = _int_query(request, "per_page", 50, MAX_PER_PAGE)
        tenant_id = request.query_params.get("tenant_id")
        if tenant_id is not None and not ID.match(tenant_id):
            raise InvalidAdminRequest("Query parameter tenant_id must be a tenant id (32 hex digits)")
        entries, total = await self.store.list_audit(page=page, per_page=per_page, tenant_id=tenant_id)
        return _paged(entries, total, page, per_page)


def admin_routes(services: AdminServices) -> list[Route]:
    """The admin API's routes, to mount under `/admin/v1`."""
    api = AdminApi(services)
    e = api.endpoint
    tenant = "/tenants/{tenant_id}"
    return [
        Route("/tenants", e(api.create_tenant), methods=["POST"]),
        Route("/tenants", e(api.list_tenants), methods=["GET"]),
        Route(tenant, e(api.get_tenant), methods=["GET"]),
        Route(tenant, e(api.update_tenant), methods=["PATCH"]),
        Route(tenant, e(api.delete_tenant), methods=["DELETE"]),
        Route(f"{tenant}/tokens", e(api.create_token), methods=["POST"]),
        Route(f"{tenant}/tokens", e(api.list_tokens), methods=["GET"]),
        Route(f"{tenant}/tokens/{{token_id}}", e(api.revoke_token), methods=["DELETE"]),
        Route(f"{tenant}/quotas", e(api.set_quotas), methods=["PUT"]),
        Route(f"{tenant}/quotas", e(api.patch_quotas), methods=["PATCH"]),
        Route(f"{tenant}/models", e(api.set_models), methods=["PUT"]),
        Route(f"{tenant}/usage", e(api.usage), methods=["GET"]),
        Route("/audit", e(api.audit), methods=["GET"]),
    ]

"""Catalog routes (reference §3, §7.2): models search with paging (`[]` past the end, so the SDK's
and wrangler's paging loops end), a model's schema, tasks, authors, memberships, and the `/models`
web page (server-rendered, no JS build).
"""

from __future__ import annotations

from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.templating import Jinja2Templates

from gateway.auth import TenantContext
from gateway.catalog import shown_name
from gateway.errors import BadInput, UnknownModel
from gateway.run import account_of, authenticate, services_of
from gateway.services import Services
from schemas.catalog import Account, Membership, ModelObject, TaskOut
from schemas.workers_ai import Envelope, PagedEnvelope, ResultInfo

MAX_PER_PAGE = 1000


def ok(result: Any, **extra: Any) -> Response:
    envelope = (
        PagedEnvelope(result=result, success=True, **extra)
        if extra
        else Envelope(result=result, success=True)
    )
    return Response(msgspec.json.encode(envelope), media_type="application/json")


def _int(request: Request, name: str, default: int, low: int, high: int) -> int:
    raw = request.query_params.get(name)
    if raw is None:
        return default
    if not _is_decimal(raw.removeprefix("-")) or not low <= int(raw) <= high:
        raise BadInput(f"Bad input: '{name}' must be an integer from {low} to {high}")
    return int(raw)


def _is_decimal(text: str) -> bool:
    """ASCII digits that `int` takes: `str.isdigit` alone admits '²', and `int` refuses more than
    4,300 digits; either would be a 500 rather than the 400 a malformed parameter is."""
    return text.isascii() and text.isdigit() and len(text) <= 18


def _bool(request: Request, name: str) -> bool:
    raw = request.query_params.get(name, "false").lower()
    if raw not in ("true", "false", "1", "0"):
        raise BadInput(f"Bad input: '{name}' must be true or false")
    return raw in ("true", "1")


def rendered(services: Services, request: Request, tenant: TenantContext | None = None) -> list[ModelObject]:
    """Catalog objects matching the query's filters (and, for a `tenant`, its allow-list: what
    `/ai/v1/models` lists and `/ai/run` serves it), with what each pool reports."""
    q = request.query_params
    source = q.get("source")
    if source is not None and not _is_decimal(source):
        raise BadInput("Bad input: 'source' must be a number")
    models = services.catalog.search(
        search=q.get("search") or None,
        task=q.get("task") or None,
        author=q.get("author") or None,
        source=int(source) if source else None,
        hide_experimental=_bool(request, "hide_experimental"),
    )
    return [
        services.catalog.render(m, services.router.card(m.pool))
        for m in models
        if tenant is None or tenant.can_use(m)
    ]


async def models_search(request: Request) -> Response:
    services = services_of(request)
    tenant = await authenticate(services, request, account_of(request))
    page = _int(request, "page", 1, 1, 1_000_000)
    per_page = _int(request, "per_page", 50, 1, MAX_PER_PAGE)
    objects = rendered(services, request, tenant)
    window = objects[(page - 1) * per_page : page * per_page]
    info = ResultInfo(page=page, per_page=per_page, count=len(window), total_count=len(objects))
    return ok(window, result_info=info)


async def model_schema(request: Request) -> Response:
    services = services_of(request)
    tenant = await authenticate(services, request, account_of(request))
    name = request.query_params.get("model")
    if not name:
        raise BadInput("Bad input: 'model' is required")
    model = services.catalog.find(name)
    if model is None or not tenant.can_use(model):  # as the search, which does not list it
        raise UnknownModel(f"No such model {shown_name(name)} or task")
    return ok(services.catalog.schema(model))


async def tasks_search(request: Request) -> Response:
    services = services_of(request)
    await authenticate(services, request, account_of(request))
    return ok([TaskOut(id=t.id, name=t.name, description=t.description) for t in services.catalog.tasks])


async def authors_search(request: Request) -> Response:
    services = services_of(request)
    await authenticate(services, request, account_of(request))
    return ok(list(services.catalog.authors))


async def memberships(request: Request) -> Response:
    """`GET /client/v4/memberships`: the token's own account (what wrangler asks without an id)."""
    services = services_of(request)
    credential = await services.authenticator.credential(request.headers.get("authorization"))
    tenant = credential.tenant
    membership = Membership(id=credential.token_id, account=Account(id=tenant.id, name=tenant.name))
    page = _int(request, "page", 1, 1, 1_000_000)
    return ok(
        [membership] if page == 1 else [],
        result_info=ResultInfo(page=page, per_page=50, count=1 if page == 1 else 0, total_count=1),
    )


async def models_page(request: Request) -> Response:
    """`/models`: the catalog as a web page, with a search box and a task filter (GET form)."""
    services = services_of(request)
    templates: Jinja2Templates = request.app.state.templates
    objects = rendered(services, request)
    rows: list[dict[str, Any]] = [
        {
            "name": o.name,
            "description": o.description,
            "task": o.task.name,
            "created_at": o.created_at,
            "properties": {p.property_id: p.value for p in o.properties if p.property_id != "price"},
            "price": next((p.value for p in o.properties if p.property_id == "price"), []),
        }
        for o in objects
    ]
    context = {
        "models": rows,
        "tasks": [t.name for t in services.catalog.tasks],
        "search": request.query_params.get("search", ""),
        "task": request.query_params.get("task", ""),
    }
    response = templates.TemplateResponse(request, "models.html", context)
    assert isinstance(response, HTMLResponse)
    return response

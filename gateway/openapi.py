"""The OpenAPI 3.1 document at `/openapi.json`: the public and admin APIs, generated from the same
msgspec Structs the routes decode and encode (`msgspec.json.schema_components`).

`OPERATIONS` lists every route of `gateway.app.routes` (a test checks that the two agree both
ways). JSON answers are the v4 envelope around the operation's result (`enveloped`), except the
OpenAI-compatible routes, which answer plain OpenAI objects. Every error is the envelope with
`result: null` and the Workers AI code (the `default` response).
"""

from __future__ import annotations

import functools
import re
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway.openapi_inputs import REF, chat_completions_input, envelope_input, run_input
from schemas.admin import (
    AuditEntry,
    Models,
    ModelsIn,
    Quotas,
    QuotasIn,
    QuotasPatch,
    Tenant,
    TenantCreate,
    TenantPatch,
    Token,
    TokenCreate,
    TokenCreated,
    UsageGroup,
)
from schemas.batch import BatchDone, BatchPoll, BatchStatus, BatchSubmit
from schemas.catalog import AuthorOut, Membership, ModelObject, ModelSpec, SchemaOut, TaskOut
from schemas.openai import ChatCompletion, ChatCompletionRequest, ModelList, ModelOut
from schemas.responses import Response as ResponseObject
from schemas.responses import ResponsesRequest
from schemas.workers_ai import ErrorItem, LegacyInput, LegacyResult, ResultInfo, RunEnvelopeInput

ACCOUNT = "/client/v4/accounts/{account_id}"
HEX32 = "^[0-9a-f]{32}$"
Security = Literal["tenant", "admin", "none"]


@dataclass(frozen=True)
class Param:
    name: str
    schema: dict[str, Any]
    where: Literal["query", "path"] = "query"
    is_required: bool = False
    description: str = ""


@dataclass(frozen=True)
class Operation:
    method: str
    path: str  # as in the route table (Starlette converters included: `{model:path}`)
    summary: str
    tag: str
    body: Any = None  # a Struct type (or a union of them)
    result: Any = None  # what the envelope's `result` holds, or the whole answer if not `enveloped`
    enveloped: bool = True
    is_paged: bool = False
    streams: bool = False  # may answer `text/event-stream` instead
    names_model: bool = False  # the body's `model` must be one of the catalog's (and is required)
    per_model: bool = False  # `{model}` is documented as one path per catalog model, with its own input
    bad_request: str = ""  # the 400s a schema-valid request may still get (what JSON Schema cannot state)
    media_type: str = "application/json"
    security: Security = "tenant"
    params: tuple[Param, ...] = field(default_factory=tuple)


def _page_params() -> tuple[Param, ...]:
    return (
        Param("page", {"type": "integer", "minimum": 1, "maximum": 1_000_000}),
        Param("per_page", {"type": "integer", "minimum": 1, "maximum": 1000}),
    )


_ID = {"type": "object", "properties": {"id": {"type": "string"}}, "required": ["id"]}
_TASKS = list[TaskOut]
AI = f"{ACCOUNT}/ai"
T = "/admin/v1/tenants/{tenant_id}"
RUN_RESULT = LegacyResult | ChatCompletion | BatchStatus | BatchDone
RUN_400 = (
    "Bad input (5006) the schema cannot state: a field this model refuses (`lora`, "
    "`functions`, `audio`, `logit_bias`, non-text `modalities`, custom tools, a tool without a name or "
    "one past OpenAI's rule (1-64 of `[A-Za-z0-9_-]`), a string `pattern` whose groups do not close, "
    "`tool_choice` naming tools not given, a `reasoning_effort` the model does not offer); JSON mode "
    "with `stream`; `raw` without `prompt`; more images or choices than the gateway serves; messages "
    "spelling special tokens more than 10,000 times; "
    "`queueRequest=true` without `{requests}`, or `{requests}` without it; a queued request that is not "
    "the model's input."
)

OPERATIONS: tuple[Operation, ...] = (
    Operation(
        "POST", f"{AI}/run/{{model:path}}", "Run a model; queue a batch (`queueRequest=true`); poll a batch",
        "inference", body=LegacyInput | ChatCompletionRequest | BatchSubmit | BatchPoll, result=RUN_RESULT,
        streams=True, params=(Param("queueRequest", {"type": "boolean"}),), per_model=True, bad_request=RUN_400,
    ),
    Operation(
        "POST", f"{AI}/run", "Run a model named in the body (`{model, input}`); queue or poll a batch", "inference",
        body=RunEnvelopeInput, result=RUN_RESULT, streams=True, names_model=True, bad_request=RUN_400,
        params=(Param("queueRequest", {"type": "boolean"}),),
    ),
    Operation(
        "POST", f"{AI}/v1/chat/completions", "OpenAI-compatible chat completions", "openai",
        body=ChatCompletionRequest, result=ChatCompletion, enveloped=False, streams=True, names_model=True,
        bad_request=RUN_400,
    ),
    Operation(
        "POST", f"{AI}/v1/responses", "OpenAI Responses API (stateless: `store` is false)", "openai",
        body=ResponsesRequest, result=ResponseObject, enveloped=False, streams=True, names_model=True,
        bad_request=RUN_400 + " For responses also: `previous_response_id`, `conversation` or `background` "
        "(nothing is stored); an input item missing what its type needs; an image by `file_id`.",
    ),
    Operation("GET", f"{AI}/v1/models", "OpenAI-compatible model list", "openai", result=ModelList, enveloped=False),
    Operation(
        "GET", f"{AI}/v1/models/{{model:path}}", "One model of the OpenAI-compatible list (404 outside it)",
        "openai", result=ModelOut, enveloped=False,
    ),
    Operation(
        "GET", f"{AI}/models/search", "Search the model catalog", "catalog", result=list[ModelObject],
        is_paged=True,
        params=(
            Param("search", {"type": "string"}), Param("task", {"type": "string"}),
            Param("author", {"type": "string"}), Param("source", {"type": "integer", "minimum": 0}),
            Param("hide_experimental", {"type": "boolean"}), *_page_params(),
        ),
    ),
    Operation(
        "GET", f"{AI}/models/schema", "A model's input and output JSON Schemas", "catalog", result=SchemaOut,
        params=(Param("model", {"type": "string", "minLength": 1, "x-catalog-model": True}, is_required=True),),
    ),
    Operation("GET", f"{AI}/tasks/search", "The catalog's tasks", "catalog", result=_TASKS),
    Operation("GET", f"{AI}/authors/search", "The catalog's authors", "catalog", result=list[AuthorOut]),
    Operation(
        "GET", "/client/v4/memberships", "The token's own account", "catalog", result=list[Membership],
        is_paged=True, params=(_page_params()[0],),
    ),
    Operation(
        "GET", "/models", "The catalog as a web page", "catalog", media_type="text/html", security="none",
        params=(Param("search", {"type": "string"}), Param("task", {"type": "string"})),
    ),
    Operation("GET", "/metrics", "Prometheus metrics", "operations", media_type="text/plain", security="admin"),
    Operation("GET", "/healthz", "Liveness", "operations", enveloped=False, security="none",
              result={"type": "object", "properties": {"status": {"const": "ok"}}, "required": ["status"]}),
    Operation("GET", "/openapi.json", "This document", "operations", enveloped=False, security="none",
              result={"type": "object"}),
    # ---- admin API --------------------------------------------------------------------------------------
    Operation("POST", "/admin/v1/tenants", "Create a tenant", "admin", body=TenantCreate, result=Tenant, security="admin"),
    Operation("GET", "/admin/v1/tenants", "List tenants", "admin", result=list[Tenant], is_paged=True,
              security="admin", params=_page_params()),
    Operation("GET", T, "A tenant", "admin", result=Tenant, security="admin"),
    Operation("PATCH", T, "Rename a tenant, change its plan, suspend or resume it", "admin", body=TenantPatch, result=Tenant, security="admin"),
    Operation("DELETE", T, "Delete a tenant (its tokens are revoked)", "admin", result=_ID, security="admin"),
    Operation("POST", f"{T}/tokens", "Create a token (its value is shown once)", "admin", body=TokenCreate,
              result=TokenCreated, security="admin", bad_request="`expires_at` in the past (6007)"),
    Operation("GET", f"{T}/tokens", "A tenant's tokens", "admin", result=list[Token], security="admin"),
    Operation("DELETE", f"{T}/tokens/{{token_id}}", "Revoke a token", "admin", result=Token, security="admin"),
    Operation("PUT", f"{T}/quotas", "Set a tenant's quotas", "admin", body=QuotasIn, result=Quotas, security="admin"),
    Operation("PATCH", f"{T}/quotas", "Change some of a tenant's quotas, keeping the others", "admin",
              body=QuotasPatch, result=Quotas, security="admin"),
    Operation("PUT", f"{T}/models", "Set a tenant's model allow-list", "admin", body=ModelsIn, result=Models,
              security="admin", bad_request="a name that is no catalog model's id or alias (6007)"),
    Operation(
        "GET", f"{T}/usage", "A tenant's usage per day or model", "admin", result=list[UsageGroup], security="admin",
        params=(
            Param("since", {"type": "string", "format": "date"}), Param("until", {"type": "string", "format": "date"}),
            Param("group_by", {"enum": ["day", "model"]}),
        ),
        bad_request="`since` after `until`, or more than 3660 days before it (6007)",
    ),
    Operation("GET", "/admin/v1/audit", "The audit log, newest first", "admin", result=list[AuditEntry],
              is_paged=True, security="admin",
              params=(*_page_params(), Param("tenant_id", {"type": "string", "pattern": HEX32}))),
)  # fmt: skip

PATH_PARAMS: dict[str, dict[str, Any]] = {
    "account_id": {"type": "string", "pattern": HEX32},
    "tenant_id": {"type": "string", "pattern": HEX32},
    "token_id": {"type": "string", "pattern": HEX32},
    "model": {"type": "string", "minLength": 1, "x-catalog-model": True},
}


def openapi_path(route_path: str) -> str:
    """`/ai/run/{model:path}` → `/ai/run/{model}` (OpenAPI has no converters)."""
    return re.sub(r"\{(\w+):\w+\}", r"{\1}", route_path)


def document(models: Sequence[ModelSpec], server_url: str | None = None) -> dict[str, Any]:
    """The whole OpenAPI 3.1 document; `models` are the catalog's (what a `model` path parameter,
    query parameter or body field may be, and what each one's input is)."""
    struct_types: list[Any] = [ErrorItem, ResultInfo]
    for op in OPERATIONS:
        for t in (op.body, op.result):
            if t is not None and not isinstance(t, dict):
                struct_types += _members(t)
    schemas, components = msgspec.json.schema_components(struct_types, schema_hook=_any, ref_template=REF)
    of = dict(zip(map(id, struct_types), schemas, strict=True))

    def schema(t: Any) -> dict[str, Any]:
        if isinstance(t, dict):
            return t
        members = _members(t)
        return of[id(t)] if len(members) == 1 else {"anyOf": [of[id(m)] for m in members]}

    components["ErrorEnvelope"] = {
        "type": "object",
        "description": "Every error: the v4 envelope with `result: null` and the Workers AI code.",
        "properties": {
            "result": {"type": "null"},
            "success": {"const": False},
            "errors": {"type": "array", "items": {"$ref": REF.format(name="ErrorItem")}, "minItems": 1},
            "messages": {"type": "array"},
        },
        "required": ["result", "success", "errors", "messages"],
    }
    names = [m.name for m in models]
    paths: dict[str, dict[str, Any]] = {}
    for op in OPERATIONS:
        for path, body in _bodies(op, models, schema):
            paths.setdefault(path, {})[op.method.lower()] = _operation(op, path, body, schema, names)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Kumo",
            "version": "1",
            "description": "A Workers-AI-compatible gateway: the Workers AI REST API, its OpenAI-compatible "
            "routes, the model catalog, and the tenant admin API.",
        },
        "servers": [{"url": server_url or "/"}],
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {
                "tenant": {"type": "http", "scheme": "bearer", "description": "A tenant's API token"},
                "admin": {"type": "http", "scheme": "bearer", "description": "An admin token"},
            },
        },
    }


def _any(t: Any) -> dict[str, Any]:
    """`object` (free-form JSON values) is any JSON value."""
    if t is object:
        return {"description": "any JSON value"}
    raise NotImplementedError(t)


def _members(t: Any) -> list[Any]:
    """A union's members (untagged Struct unions are documented as `anyOf`), else `[t]`."""
    return list(typing.get_args(t)) if isinstance(t, types.UnionType) else [t]


def _model_names(param: dict[str, Any], models: list[str]) -> dict[str, Any]:
    if not param.get("x-catalog-model"):
        return param
    return {k: v for k, v in param.items() if k != "x-catalog-model"} | {"enum": models}


def _bodies(
    op: Operation, models: Sequence[ModelSpec], schema: Any
) -> list[tuple[str, dict[str, Any] | None]]:
    """The operation's documented paths, each with its request body's schema."""
    path = openapi_path(op.path)
    if op.per_model:
        return [(path.replace("{model}", m.name), run_input(m.family)) for m in models]
    if "{model}" in path:  # a path per catalog model, no body (`GET …/v1/models/{model}`)
        return [(path.replace("{model}", m.name), None) for m in models]
    if op.body is RunEnvelopeInput:
        return [(path, envelope_input(models))]
    if op.body is ChatCompletionRequest:
        return [(path, chat_completions_input())]
    return [(path, None if op.body is None else schema(op.body))]


def _operation(
    op: Operation, path: str, body: dict[str, Any] | None, schema: Any, models: list[str]
) -> dict[str, Any]:
    out: dict[str, Any] = {
        "summary": op.summary,
        "tags": [op.tag],
        "operationId": re.sub(r"\W+", "_", f"{op.method.lower()}{path}").strip("_"),
    }
    params = [
        {"name": n, "in": "path", "required": True, "schema": _model_names(PATH_PARAMS[n], models)}
        for n in re.findall(r"\{(\w+)\}", path)
    ]
    params += [
        {
            "name": p.name,
            "in": p.where,
            "required": p.is_required,
            "schema": _model_names(p.schema, models),
            **({"description": p.description} if p.description else {}),
        }
        for p in op.params
    ]
    if params:
        out["parameters"] = params
    if body is not None:
        if op.names_model:
            body = {"allOf": [body, {"properties": {"model": {"enum": models}}, "required": ["model"]}]}
        out["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    out["security"] = [] if op.security == "none" else [{op.security: []}]
    out["responses"] = {"200": _success(op, schema), "default": _error()}
    if op.bad_request:
        out["responses"]["400"] = _error(op.bad_request)
    if op.streams:  # a generation
        out["responses"]["408"] = _error("The wall-clock limit (`cf-aig-request-timeout`) ended it (3046)")
        out["responses"]["413"] = _error(
            "The input's tokens plus its maximum output tokens over the context window a replica admits "
            "(the catalog's `context_window`: the model's, or less where its KV page pool is smaller) (5021); "
            "a body or its images past the gateway's limits (3006)"
        )
    return out


def _success(op: Operation, schema: Any) -> dict[str, Any]:
    if op.media_type != "application/json":
        return {"description": "OK", "content": {op.media_type: {"schema": {"type": "string"}}}}
    body = schema(op.result)
    if op.enveloped:
        props: dict[str, Any] = {
            "result": body,
            "success": {"const": True},
            "errors": {"type": "array", "maxItems": 0},
            "messages": {"type": "array"},
        }
        if op.is_paged:
            props["result_info"] = {"$ref": REF.format(name="ResultInfo")}
        body = {
            "type": "object",
            "properties": props,
            "required": ["result", "success", "errors", "messages"],
        }
    content: dict[str, Any] = {"application/json": {"schema": body}}
    if op.streams:
        content["text/event-stream"] = {"schema": {"type": "string"}}
    return {"description": "OK", "content": content}


def _error(
    description: str = "An error (4xx/5xx) with its Workers AI code; 429 and 503 carry `Retry-After`",
) -> dict[str, Any]:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": REF.format(name="ErrorEnvelope")}}},
    }


class Published:
    """`GET /openapi.json` for one catalog's models. They do not change while the app serves, so
    the document is encoded on the first request and the same bytes answered after: a build costs
    ~12-19 ms of event-loop CPU, on a route that needs no credentials."""

    def __init__(self, models: Sequence[ModelSpec]) -> None:
        self._models = models

    @functools.cached_property
    def body(self) -> bytes:
        return msgspec.json.encode(document(self._models))

    async def respond(self, request: Request) -> Response:
        return Response(self.body, media_type="application/json")

"""OpenAI-compatible routes under `…/ai/v1` (reference §4): plain OpenAI bodies and chunks (no
Workers AI trailer; usage through `stream_options.include_usage`), errors in the Cloudflare
envelope. The `openai` package works with `base_url=…/accounts/{account_id}/ai/v1`, for Chat
Completions and for the Responses API (`gateway.responses`).
"""

from __future__ import annotations

from datetime import UTC, datetime

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import responses
from gateway.body import decode
from gateway.catalog import shown_name
from gateway.errors import BadInput, NotFound
from gateway.inference import Prompt, Stream
from gateway.run import (
    StreamResponse,
    account_of,
    authenticate,
    meta_of,
    read_input,
    resolve_model,
    respond,
    services_of,
    unless_client_leaves,
)
from gateway.services import Services
from schemas.catalog import ModelSpec
from schemas.openai import ChatCompletionRequest, ModelList, ModelOut
from schemas.responses import ResponsesRequest
from schemas.workers_ai import WireIn


class ModelField(WireIn, kw_only=True, forbid_unknown_fields=False):
    """Only `model`: read when the body does not decode, so that the model is authorised first."""

    model: str | None = None


_model_decoder = msgspec.json.Decoder(ModelField)
_chat_decoder = msgspec.json.Decoder(ChatCompletionRequest)
_responses_decoder = msgspec.json.Decoder(ResponsesRequest)


async def chat_completions(request: Request) -> Response:
    """`POST …/ai/v1/chat/completions`: the model named in the body (5007 unknown, 403 not allowed)
    is checked before the rest of the body, whose errors come after."""
    services = services_of(request)
    meta = meta_of(services, request)
    account_id = account_of(request)
    tenant = await authenticate(services, request, account_id)
    raw = await read_input(services, request, meta)
    try:
        body = decode(raw, _chat_decoder)
    except BadInput:
        head = decode(raw, _model_decoder)
        resolve_model(services, request, tenant, _required(head.model))
        raise
    model = resolve_model(services, request, tenant, _required(body.model))
    answer = await unless_client_leaves(
        request, services.inference.run(tenant, model, Prompt(body, raw), "openai", meta)
    )
    return respond(answer, "openai")


async def create_response(request: Request) -> Response:
    """`POST …/ai/v1/responses`: the Responses API, stateless; checked in the same order as chat
    completions (the model first, then the rest of the body)."""
    services = services_of(request)
    meta = meta_of(services, request)
    account_id = account_of(request)
    tenant = await authenticate(services, request, account_id)
    raw = await read_input(services, request, meta)
    try:
        body = decode(raw, _responses_decoder)
    except BadInput:
        head = decode(raw, _model_decoder)
        resolve_model(services, request, tenant, _required(head.model))
        raise
    model = resolve_model(services, request, tenant, _required(body.model))
    chat = responses.to_chat(body)
    answer = await unless_client_leaves(
        request, services.inference.run(tenant, model, Prompt(chat, raw), "openai", meta)
    )
    echo, id = responses.Echo.of(body), f"resp_{meta.info.request_id}"
    if isinstance(answer, Stream):
        return StreamResponse(answer, responses.events_of(answer, model, echo, id))
    return Response(
        msgspec.json.encode(responses.response_of(answer, model, echo, id)), media_type="application/json"
    )


def _required(model: str | None) -> str:
    if not model:
        raise BadInput("Bad input: 'model' is required")
    return model


async def list_models(request: Request) -> Response:
    """`GET …/ai/v1/models`: the tenant's servable text-generation models as an OpenAI list."""
    services = services_of(request)
    tenant = await authenticate(services, request, account_of(request))
    models: list[ModelSpec] = [m for m in services.catalog.models if tenant.can_use(m)]
    data = [_model_out(services, m) for m in models]
    return Response(msgspec.json.encode(ModelList(data=data)), media_type="application/json")


async def retrieve_model(request: Request) -> Response:
    """`GET …/ai/v1/models/{model}` (the SDKs' `models.retrieve`): one model of the list, or 404 for a
    model the tenant may not use or the catalog lacks (the list does not show those either)."""
    services = services_of(request)
    tenant = await authenticate(services, request, account_of(request))
    name = request.path_params["model"]
    model = services.catalog.find(name)
    if model is None or not tenant.can_use(model):
        raise NotFound(f"No such model {shown_name(name)}")
    return Response(msgspec.json.encode(_model_out(services, model)), media_type="application/json")


def _model_out(services: Services, m: ModelSpec) -> ModelOut:
    card = services.router.card(m.pool)
    window = card.max_request_tokens if card is not None else msgspec.UNSET
    return ModelOut(id=m.name, created=_created(m.created_at), owned_by=m.author, context_window=window)


def _created(created_at: str) -> int:
    """The catalog's `YYYY-MM-DD HH:MM:SS.mmm` (UTC) as OpenAI's unix seconds."""
    return int(datetime.strptime(created_at, "%Y-%m-%d %H:%M:%S.%f").replace(tzinfo=UTC).timestamp())

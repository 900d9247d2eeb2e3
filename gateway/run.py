"""`POST /client/v4/accounts/{account_id}/ai/run/{model}` and `POST …/ai/run` (reference §1).

The model id arrives raw (`@cf/meta/x`) or with `/` percent-encoded (cloudflare-python 5.x sends
`@cf%2Fmeta%2Fx`); a catch-all path parameter takes both. Streams are not enveloped.
"""

from __future__ import annotations

import re
from urllib.parse import unquote

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from gateway import batch
from gateway.auth import TenantContext
from gateway.body import decode, read_body
from gateway.errors import BadInput, NoRoute
from gateway.inference import Call, authenticate, resolve_model
from gateway.services import Services
from schemas.catalog import ModelSpec
from schemas.workers_ai import RunEnvelopeInput

ACCOUNT_ID = re.compile(r"^[0-9a-f]{32}$")
_envelope_decoder = msgspec.json.Decoder(RunEnvelopeInput)


def services_of(request: Request) -> Services:
    services: Services = request.app.state.services
    return services


def account_of(request: Request) -> str:
    """The path's account id; a malformed one is 404/7003 as on Cloudflare."""
    account_id = str(request.path_params["account_id"])
    if not ACCOUNT_ID.match(account_id):
        raise NoRoute(f"Could not route to {request.url.path}, perhaps your object identifier is invalid?")
    return account_id


async def run_model(request: Request) -> Response:
    """`/ai/run/{model}`: the body is the model's input."""
    services = services_of(request)
    account_id = account_of(request)
    name = str(request.path_params["model"])
    name = unquote(name) if "%" in name else name
    tenant = await authenticate(services, request, account_id)
    model = resolve_model(services, request, tenant, name)
    raw = await read_body(request, services.settings.max_body_bytes, services.settings.body_read_timeout_s)
    return await _run(request, tenant, model, raw)


async def run_envelope(request: Request) -> Response:
    """`/ai/run` with `{model, input}` (`cf-aig-gateway-id` accepted, not required)."""
    services = services_of(request)
    account_id = account_of(request)
    tenant = await authenticate(services, request, account_id)
    raw = await read_body(request, services.settings.max_body_bytes, services.settings.body_read_timeout_s)
    envelope = decode(raw, _envelope_decoder)
    assert isinstance(envelope, RunEnvelopeInput)
    model = resolve_model(services, request, tenant, envelope.model)
    inner = bytes(envelope.input)
    is_batch = batch.is_queue_request(request) or batch.poll_id(inner) is not None
    if envelope.options is not None and envelope.options.rejectIfBusy and not is_batch:
        inner = _with_reject_if_busy(inner)
    return await _run(request, tenant, model, inner)


async def _run(request: Request, tenant: TenantContext, model: ModelSpec, raw: bytes) -> Response:
    """The model's input run now, or (reference §1.6) a batch queued (`?queueRequest=true` with
    `{requests}`) or polled (`{request_id}`): the same for `/ai/run/{model}` and `/ai/run`'s input."""
    services = services_of(request)
    if batch.is_queue_request(request):
        return await batch.submit(services, tenant, model, raw)
    job_id = batch.poll_id(raw)
    if job_id is not None:
        return await batch.poll(services, tenant, model, job_id)
    return await Call(services, request, tenant, model, "run").handle(raw)


def _with_reject_if_busy(raw: bytes) -> bytes:
    """The envelope's `options.rejectIfBusy` applies to the inner input."""
    inner = msgspec.json.decode(raw)
    if isinstance(inner, dict):
        options = inner.get("options")
        if options is not None and not isinstance(options, dict):
            raise BadInput("Bad input: 'input.options' must be an object")
        inner["options"] = {**(options or {}), "rejectIfBusy": True}
    return msgspec.json.encode(inner)

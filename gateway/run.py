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
from gateway.body import decode, read_body
from gateway.errors import BadInput, NoRoute, Unsupported
from gateway.inference import Call, authenticate, resolve_model
from gateway.services import Services
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
    if batch.is_queue_request(request):  # async batch (reference §1.6)
        return await batch.submit(services, tenant, model, raw)
    job_id = batch.poll_id(raw)
    if job_id is not None:
        return await batch.poll(services, tenant, model, job_id)
    call = Call(services, request, tenant, model, "run")
    return await call.handle(raw)


async def run_envelope(request: Request) -> Response:
    """`/ai/run` with `{model, input}` (`cf-aig-gateway-id` accepted, not required)."""
    services = services_of(request)
    account_id = account_of(request)
    tenant = await authenticate(services, request, account_id)
    raw = await read_body(request, services.settings.max_body_bytes, services.settings.body_read_timeout_s)
    envelope = decode(raw, _envelope_decoder)
    assert isinstance(envelope, RunEnvelopeInput)
    model = resolve_model(services, request, tenant, envelope.model)
    _refuse_queue(request)
    inner = bytes(envelope.input)
    if envelope.options is not None and envelope.options.rejectIfBusy:
        inner = _with_reject_if_busy(inner)
    call = Call(services, request, tenant, model, "run")
    return await call.handle(inner)


def _refuse_queue(request: Request) -> None:
    if request.query_params.get("queueRequest", "").lower() == "true":
        raise Unsupported("Bad input: 'queueRequest' (the async batch API) is not served")


def _with_reject_if_busy(raw: bytes) -> bytes:
    """The envelope's `options.rejectIfBusy` applies to the inner input."""
    inner = msgspec.json.decode(raw)
    if isinstance(inner, dict):
        options = inner.get("options")
        if options is not None and not isinstance(options, dict):
            raise BadInput("Bad input: 'input.options' must be an object")
        inner["options"] = {**(options or {}), "rejectIfBusy": True}
    return msgspec.json.encode(inner)

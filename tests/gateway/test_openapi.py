# ruff: noqa: F811  (pytest fixtures imported by name)
"""The OpenAPI document against the route table: every route documented, every documented route
served, and the document itself valid OpenAPI 3.1 whose schemas accept what the gateway answers."""

from __future__ import annotations

from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from gateway_harness import GLM, LEGACY, Harness, harness  # noqa: F401  (fixture)
from starlette.applications import Starlette
from starlette.routing import Mount, Route

from gateway import openapi
from gateway.app import routes
from gateway.openapi import OPERATIONS, document, openapi_path


def served(harness: Harness) -> set[tuple[str, str]]:
    out = set()
    for r in routes(harness.services):
        inner = r.routes if isinstance(r, Mount) else [r]
        prefix = r.path if isinstance(r, Mount) else ""
        for route in inner:
            assert isinstance(route, Route)
            out |= {(m, prefix + route.path) for m in route.methods or () if m != "HEAD"}
    return out


def test_every_route_is_documented_and_every_documented_route_served(harness: Harness) -> None:
    documented = {(op.method, op.path) for op in OPERATIONS}
    assert served(harness) - documented == set(), "routes missing from the OpenAPI document"
    assert documented - served(harness) == set(), "documented operations no route serves"
    models = harness.services.catalog.models
    doc = document(models)
    # `/ai/run/{model}` is one path per catalog model
    expected = {(m, openapi_path(p)) for m, p in documented if "{model" not in p}
    expected |= {(m, openapi_path(p).replace("{model}", spec.name)) for m, p in documented if "{model" in p
                 for spec in models}  # fmt: skip
    assert {(m.upper(), p) for p, ops in doc["paths"].items() for m in ops} == expected


async def test_the_document_is_served_and_valid(harness: Harness) -> None:
    r = await harness.http.get(f"{harness.url}/openapi.json")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    doc = r.json()
    assert doc["openapi"] == "3.1.0" and doc == document(harness.services.catalog.models)
    legacy = doc["paths"][f"/client/v4/accounts/{{account_id}}/ai/run/{LEGACY}"]["post"]
    glm = doc["paths"][f"/client/v4/accounts/{{account_id}}/ai/run/{GLM}"]["post"]
    assert "LegacyInput" in str(legacy["requestBody"]) and "ChatCompletionRequest" not in str(
        legacy["requestBody"]
    )
    assert "ChatCompletionRequest" in str(glm["requestBody"]) and "LegacyInput" not in str(glm["requestBody"])
    assert "context window" in legacy["responses"]["413"]["description"]  # 5021 is a 413 (the wire format)
    loaded = schemathesis.openapi.from_dict(doc)  # parses every operation, its parameters and bodies
    operations = [result.ok() for result in loaded.get_all_operations()]
    assert len(operations) == sum(len(ops) for ops in doc["paths"].values()) >= len(OPERATIONS)


async def test_the_document_is_built_once_and_served_as_the_same_bytes(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`/openapi.json` needs no credentials: each call must not rebuild the document (~19 ms of CPU)."""
    builds: list[int] = []

    def counted(models: Any, server_url: str | None = None) -> dict[str, Any]:
        builds.append(1)
        return document(models, server_url)

    monkeypatch.setattr(openapi, "document", counted)
    app = Starlette(routes=routes(harness.services))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://kumo") as http:
        first, second = [await http.get("/openapi.json") for _ in range(2)]
    assert first.status_code == second.status_code == 200
    assert first.content == second.content and len(builds) == 1


async def test_answers_match_the_documented_schemas(harness: Harness) -> None:
    """A few real answers, each checked against its operation's 200 or default schema."""
    doc = document(harness.services.catalog.models)

    def check(path: str, method: str, status: int, body: object) -> None:
        responses = doc["paths"][path][method]["responses"]
        documented = str(status) if str(status) in responses else "default"
        schema = responses[documented]["content"]["application/json"]["schema"]
        jsonschema_rs.Draft202012Validator({**schema, "components": doc["components"]}).validate(body)

    run = "/client/v4/accounts/{account_id}/ai/run/"
    for model, body in (
        (LEGACY, {"prompt": "hi"}),
        (GLM, {"messages": [{"role": "user", "content": "hi"}]}),
        (GLM, {"x": 1}),
    ):
        r = await harness.http.post(harness.path(f"/ai/run/{model}"), headers=harness.auth(), json=body)
        check(run + model, "post", r.status_code, r.json())
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}?queueRequest=true"),
        headers=harness.auth(),
        json={"requests": [{"prompt": "q"}]},
    )
    check(run + LEGACY, "post", r.status_code, r.json())
    r = await harness.http.get(harness.path("/ai/models/search"), headers=harness.auth())
    check("/client/v4/accounts/{account_id}/ai/models/search", "get", r.status_code, r.json())
    r = await harness.http.get(harness.path("/ai/v1/models"), headers=harness.auth())
    check("/client/v4/accounts/{account_id}/ai/v1/models", "get", r.status_code, r.json())

# ruff: noqa: F811  (pytest fixtures imported by name)
"""Catalog routes (§3, §7): search filters, paging that ends (`[]` past the end), schema, tasks,
authors, memberships, and the `/models` page."""

from __future__ import annotations

import re
import uuid

import msgspec
import pytest
from gateway_harness import GLM, KIMI, LEGACY, MISMATCH, Harness, harness  # noqa: F401  (fixture)
from sqlalchemy.exc import OperationalError

from gateway.catalog import Catalog, CatalogError, family_schema, load_catalog_file
from schemas.admin import TokenCreate
from schemas.backend import Capabilities, ModelCard


async def get(h: Harness, rest: str, **params: object):  # type: ignore[no-untyped-def]
    return await h.http.get(h.path(rest), headers=h.auth(), params=params)


def props(entry: dict) -> dict:  # type: ignore[type-arg]
    return {p["property_id"]: p["value"] for p in entry["properties"]}


async def test_search_lists_entries_with_workers_ai_fields(harness: Harness) -> None:
    r = await get(harness, "/ai/models/search")
    assert r.status_code == 200
    body = r.json()
    assert body["success"] is True and body["result_info"]["total_count"] == 4
    kimi = next(e for e in body["result"] if e["name"] == KIMI)
    uuid.UUID(kimi["id"])
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\.\d{3}", kimi["created_at"])
    assert kimi["task"] == {
        "id": "c329a1f9-323d-4e91-b2aa-582dd4188d34",
        "name": "Text Generation",
        "description": kimi["task"]["description"],
    }
    p = props(kimi)
    assert p["context_window"] == "4096"  # what the pool's backend reports, not the published 262144
    assert p["vision"] == "true" and p["function_calling"] == "true" and p["require_workers_paid"] == "true"
    assert p["async_queue"] == "true"  # the gateway queues async batches (gateway.batch)
    assert all(isinstance(v, str) for k, v in p.items() if k != "price")
    assert {x["unit"] for x in p["price"]} == {
        "per M input tokens",
        "per M output tokens",
        "per M cached input tokens",
    }
    assert (
        "trained by Kumo" in kimi["description"] and "not the 1T-parameter Kimi K2.6" in kimi["description"]
    )
    assert not any("seed" in e["description"] for e in body["result"])  # in a user's words, no jargon
    glm = props(next(e for e in body["result"] if e["name"] == GLM))
    assert "vision" not in glm
    assert "context_window" not in props(next(e for e in body["result"] if e["name"] == MISMATCH))


async def test_filters_and_paging_end(harness: Harness) -> None:
    assert [e["name"] for e in (await get(harness, "/ai/models/search", search="kimi")).json()["result"]] == [
        KIMI
    ]
    assert {
        e["name"] for e in (await get(harness, "/ai/models/search", author="zai-org")).json()["result"]
    } == {GLM}
    assert (await get(harness, "/ai/models/search", task="Text Embeddings")).json()["result"] == []
    visible = (await get(harness, "/ai/models/search", hide_experimental="true")).json()["result"]
    assert MISMATCH not in {e["name"] for e in visible}
    seen = []
    for page in range(1, 10):
        result = (await get(harness, "/ai/models/search", page=page, per_page=3)).json()["result"]
        if not result:
            break
        seen += [e["name"] for e in result]
    assert page == 3 and len(seen) == len(set(seen)) == 4
    for value in ("lots", ""):  # an empty value is no integer either
        bad = await get(harness, "/ai/models/search", per_page=value)
        assert bad.status_code == 400 and "per_page" in bad.json()["errors"][0]["message"]


async def test_a_schema_is_generated_once_and_answered_the_same(harness: Harness) -> None:
    family_schema.cache_clear()
    answers = [await get(harness, "/ai/models/schema", model=model) for model in (KIMI, GLM, KIMI, GLM)]
    assert all(r.status_code == 200 for r in answers)
    assert answers[0].content == answers[1].content == answers[2].content == answers[3].content
    info = family_schema.cache_info()
    assert (info.misses, info.hits) == (1, 3)  # Kimi and GLM share the OpenAI family's


async def test_schema_tasks_authors_memberships(harness: Harness) -> None:
    schema = (await get(harness, "/ai/models/schema", model=KIMI)).json()["result"]
    assert "max_completion_tokens" in str(schema["input"]) and "text/event-stream" in str(schema["output"])
    legacy = (await get(harness, "/ai/models/schema", model=LEGACY)).json()["result"]
    assert "repetition_penalty" in str(legacy["input"])
    assert (await get(harness, "/ai/models/schema", model="@cf/x/y")).json()["errors"][0]["code"] == 5007
    tasks = (await get(harness, "/ai/tasks/search")).json()["result"]
    assert tasks[0]["name"] == "Text Generation"
    authors = {a["name"] for a in (await get(harness, "/ai/authors/search")).json()["result"]}
    assert {"moonshotai", "zai-org"} <= authors
    m = await harness.http.get(f"{harness.url}/client/v4/memberships", headers=harness.auth())
    assert m.json()["result"][0]["account"]["id"] == harness.account
    assert (await harness.http.get(f"{harness.url}/client/v4/memberships")).status_code == 401
    other = await harness.http.get(
        harness.path("/ai/models/search", account=harness.free_account), headers=harness.auth()
    )
    assert other.status_code == 403


async def test_models_page_has_search_and_task_filter(harness: Harness) -> None:
    page = await harness.http.get(f"{harness.url}/models")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert 'type="search"' in page.text and '<select name="task"' in page.text
    assert KIMI in page.text and GLM in page.text and "4096 tokens" in page.text
    found = await harness.http.get(f"{harness.url}/models", params={"search": "glm"})
    assert GLM in found.text and KIMI not in found.text
    none = await harness.http.get(f"{harness.url}/models", params={"task": "Text Embeddings"})
    assert "No model matches." in none.text


def test_capabilities_are_those_the_backend_serves() -> None:
    catalog = Catalog.from_file(load_catalog_file(None))
    kimi = catalog.get(KIMI)
    card = ModelCard(
        name="k", architecture=kimi.architecture, family="kimi", weights="int4-w4a16", kv_dtype="fp8_e4m3",
        context_window=262144, page_size=16, num_pages=16384, capabilities=Capabilities(tools=False, reasoning=True, vision=True),
    )  # fmt: skip
    shown = {p.property_id: p.value for p in catalog.render(kimi, card).properties}
    assert "function_calling" not in shown and shown["reasoning"] == "true" and shown["vision"] == "true"
    assert (shown["context_window"], shown["weights"], shown["kv_cache_dtype"]) == (
        "262144",
        "int4-w4a16",
        "fp8_e4m3",
    )
    # a pool smaller than the window: the catalog shows what one request can get, as /v1/load's pages do
    small = msgspec.structs.replace(card, num_pages=8)
    shown = {p.property_id: p.value for p in catalog.render(kimi, small).properties}
    assert shown["context_window"] == "128"


async def test_a_retired_id_is_served_by_its_successor(harness: Harness) -> None:
    r = await harness.http.post(
        harness.path("/ai/run/@cf/moonshotai/kimi-k2.5"), headers=harness.auth(), json={"prompt": "old"}
    )
    assert r.status_code == 200 and r.json()["result"]["model"] == KIMI
    names = [e["name"] for e in (await get(harness, "/ai/models/search")).json()["result"]]
    assert "@cf/moonshotai/kimi-k2.5" not in names


async def test_models_page_escapes_what_it_echoes(harness: Harness) -> None:
    page = await harness.http.get(f"{harness.url}/models", params={"search": '"><script>alert(1)</script>'})
    assert "<script>alert(1)</script>" not in page.text and "&lt;script&gt;" in page.text


def test_an_entry_cannot_set_a_property_the_gateway_computes() -> None:
    """`properties` carries extra strings (terms, info); a capability or the context window typed
    there would be advertised whatever the pool serves, and listed twice."""
    file = load_catalog_file(None)
    glm = next(m for m in file.models if m.name == GLM)
    for key in ("vision", "context_window", "async_queue", "price"):
        forged = msgspec.structs.replace(glm, properties={**glm.properties, key: "true"})
        others = [m for m in file.models if m.name != GLM]
        with pytest.raises(CatalogError, match=key):
            Catalog.from_file(msgspec.structs.replace(file, models=[*others, forged]))


async def test_memberships_with_the_database_away_is_503_not_a_crash(
    harness: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = harness.services.store
    token = await store.create_token(harness.account, TokenCreate(name="wrangler"), actor="test")

    async def unreachable(value: str) -> None:
        raise OperationalError("SELECT", None, ConnectionRefusedError())

    monkeypatch.setattr(store, "resolve_token", unreachable)
    r = await harness.http.get(f"{harness.url}/client/v4/memberships", headers=harness.auth(token.value))
    assert r.status_code == 503 and r.json()["errors"][0]["code"] == 3040, r.text
    assert "retry-after" in r.headers

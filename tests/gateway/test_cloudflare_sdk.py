# ruff: noqa: F811  (pytest fixtures imported by name)
"""The official `cloudflare` Python SDK (5.x) against the gateway (reference §7.1): `ai.run` with
the model id's slashes percent-encoded, paging through `ai.models.list` ending, schema, tasks."""

from __future__ import annotations

import cloudflare
import httpx
import pytest
from gateway_harness import GLM, KIMI, LEGACY, Harness, harness  # noqa: F401  (fixture)


def sdk(h: Harness, token: str | None = None, paths: list[bytes] | None = None) -> cloudflare.AsyncCloudflare:
    async def record(request: httpx.Request) -> None:
        if paths is not None:
            paths.append(request.url.raw_path)

    http = httpx.AsyncClient(event_hooks={"request": [record]})
    return cloudflare.AsyncCloudflare(
        api_token=token or h.token, base_url=f"{h.url}/client/v4", max_retries=0, http_client=http
    )


async def test_run_unwraps_result_for_both_families(harness: Harness) -> None:
    paths: list[bytes] = []
    async with sdk(harness, paths=paths) as client:
        legacy = await client.ai.run(LEGACY, account_id=harness.account, prompt="hi sdk")
        assert legacy == {"response": "echo: hi sdk", "usage": legacy["usage"]}  # type: ignore[index]
        openai_native = await client.ai.run(
            KIMI, account_id=harness.account, messages=[{"role": "user", "content": "yo"}]
        )
        assert openai_native["choices"][0]["message"]["content"] == "echo: yo"  # type: ignore[index]
    assert b"/ai/run/@cf%2Fkumo%2Flegacy-test" in paths[0]  # 5.x percent-encodes the slashes


async def test_models_list_pages_until_empty(harness: Harness) -> None:
    async with sdk(harness) as client:
        names = [m["name"] async for m in client.ai.models.list(account_id=harness.account, per_page=1)]  # type: ignore[index]
        assert sorted(names) == sorted({KIMI, GLM, LEGACY, "@cf/kumo/mismatch"})
        schema = await client.ai.models.schema.get(account_id=harness.account, model=GLM)
        assert schema is not None and "messages" in str(schema.input)
        tasks = [t async for t in client.ai.tasks.list(account_id=harness.account)]
        assert tasks[0]["name"] == "Text Generation"  # type: ignore[index]


async def test_errors_raise_the_sdk_exceptions(harness: Harness) -> None:
    async with sdk(harness, token="kumo_bad") as client:
        with pytest.raises(cloudflare.AuthenticationError):
            await client.ai.run(KIMI, account_id=harness.account, prompt="x")
    async with sdk(harness) as client:
        with pytest.raises(cloudflare.BadRequestError) as bad:
            await client.ai.run("@cf/nope/nope", account_id=harness.account, prompt="x")
        assert bad.value.response.json()["errors"][0]["code"] == 5007

# ruff: noqa: F811  (pytest fixtures imported by name)
"""`…/ai/v1`: the official `openai` package as the client (reference §4)."""

from __future__ import annotations

import openai
import pytest
from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)


def client(h: Harness, token: str | None = None, account: str | None = None) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        api_key=token or h.token,
        base_url=f"{h.url}/client/v4/accounts/{account or h.account}/ai/v1",
        max_retries=0,
        default_headers={"x-session-affinity": "ses_openai"},
    )


async def test_chat_completion_with_reasoning_and_tools(harness: Harness) -> None:
    async with client(harness) as c:
        done = await c.chat.completions.create(
            model=KIMI, messages=[{"role": "user", "content": "think:hello"}], max_tokens=32
        )
        assert done.choices[0].message.content == "echo: hello"
        assert done.choices[0].message.model_extra["reasoning_content"] == "Let me think."  # type: ignore[index]
        assert done.usage is not None and done.usage.prompt_tokens_details.cached_tokens == 4  # type: ignore[union-attr]
        assert done.model == KIMI and done.object == "chat.completion"
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ]
        called = await c.chat.completions.create(
            model=GLM, messages=[{"role": "user", "content": "tool:"}], tools=tools
        )  # type: ignore[arg-type]
        calls = called.choices[0].message.tool_calls or []
        assert called.choices[0].finish_reason == "tool_calls"
        assert [(t.function.name, t.function.arguments) for t in calls] == [
            ("get_weather", '{"city": "Lisbon"}'),
            ("get_weather", '{"city": "Porto"}'),
        ]  # type: ignore[union-attr]


async def test_stream_has_no_workers_trailer_and_usage_on_request(harness: Harness) -> None:
    async with client(harness) as c:
        stream = await c.chat.completions.create(
            model=KIMI,
            messages=[{"role": "user", "content": "hi there"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    assert text == "echo: hi there"
    assert chunks[-1].choices == [] and chunks[-1].usage is not None and chunks[-1].usage.total_tokens > 0
    assert all(ch.object == "chat.completion.chunk" for ch in chunks)
    assert all("p" not in (ch.model_extra or {}) for ch in chunks)


async def test_errors_come_back_in_the_cloudflare_envelope(harness: Harness) -> None:
    async with client(harness) as c:
        with pytest.raises(openai.BadRequestError) as bad:
            await c.chat.completions.create(model="@cf/foo/bar", messages=[{"role": "user", "content": "x"}])
        assert bad.value.response.json()["errors"][0]["code"] == 5007
        with pytest.raises(openai.BadRequestError) as refused:
            await c.chat.completions.create(
                model=KIMI, messages=[{"role": "user", "content": "x"}], logit_bias={"1": 5}
            )
        assert "logit_bias" in refused.value.response.json()["errors"][0]["message"]
        with pytest.raises(openai.APIError):
            stream = await c.chat.completions.create(
                model=KIMI, messages=[{"role": "user", "content": "crash"}], stream=True
            )
            async for _ in stream:
                pass
    async with client(harness, token="kumo_wrong") as c:
        with pytest.raises(openai.AuthenticationError):
            await c.chat.completions.create(model=KIMI, messages=[{"role": "user", "content": "x"}])
    async with client(harness, token=harness.free_token, account=harness.free_account) as c:
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await c.chat.completions.create(model=KIMI, messages=[{"role": "user", "content": "x"}])
        assert denied.value.response.json()["errors"][0]["code"] == 5035


async def test_models_list(harness: Harness) -> None:
    async with client(harness) as c:
        models = [m async for m in c.models.list()]
    assert {KIMI, GLM} <= {m.id for m in models}
    kimi = next(m for m in models if m.id == KIMI)
    assert kimi.owned_by == "moonshotai" and kimi.created > 1_700_000_000
    assert kimi.model_extra is not None and kimi.model_extra["context_window"] > 0  # what a replica admits
    async with client(harness) as c:
        one = await c.models.retrieve(GLM)  # the id's slashes in the path
        assert (
            one.id == GLM
            and one.owned_by == "zai-org"
            and one.model_extra
            == {
                "context_window": next(m for m in models if m.id == GLM).model_extra["context_window"]  # type: ignore[index]
            }
        )
        with pytest.raises(openai.NotFoundError):
            await c.models.retrieve("@cf/nobody/nothing")
    async with client(harness, token=harness.free_token, account=harness.free_account) as c:
        free = [m.id async for m in c.models.list()]
        for name in (KIMI, GLM):  # a model the list leaves out is not there to retrieve either
            if name not in free:
                with pytest.raises(openai.NotFoundError):
                    await c.models.retrieve(name)

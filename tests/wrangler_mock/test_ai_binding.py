"""`env.AI` semantics (workers-ai-api.md §7.3) against the fake gateway, in-process."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
from fake_workers_ai import ACCOUNT, LEGACY_MODEL, OPENAI_MODEL, TOKEN, FakeGateway
from wm_support import free_port
from wrangler_mock.ai_binding import Ai
from wrangler_mock.api import CloudflareApi
from wrangler_mock.errors import GatewayUnreachable, InferenceUpstreamError
from wrangler_mock.jsvalue import JsException, JsObject, ReadableStream
from wrangler_mock.response import Response
from wrangler_mock.settings import Credentials
from wrangler_mock.shims.js import Object
from wrangler_mock.shims.pyodide.ffi import to_js


@pytest.fixture
async def ai(fake: FakeGateway, credentials: Credentials) -> AsyncIterator[Ai]:
    async with CloudflareApi.make_client(httpx.ASGITransport(app=fake.app)) as client:
        yield Ai(CloudflareApi(credentials, client))


def js(obj: dict) -> JsObject:
    return to_js(obj, dict_converter=Object.fromEntries)


async def test_run_returns_the_unwrapped_result(ai: Ai) -> None:
    result = await ai.run(LEGACY_MODEL, js({"prompt": "hi"}))
    assert result.to_py() == {
        "response": "echo: hi",
        "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
    }
    assert result.response == "echo: hi" and result["response"] == "echo: hi"
    assert ai.lastRequestId is not None and ai.lastRequestId.startswith("req-")


async def test_run_accepts_plain_dicts_and_openai_bodies(ai: Ai) -> None:
    result = await ai.run(OPENAI_MODEL, {"messages": [{"role": "user", "content": "yo"}]})
    assert result.to_py()["choices"][0]["message"]["content"] == "echo: yo"
    assert result.choices[0].message.content == "echo: yo"


async def test_stream_returns_the_sse_bytes(ai: Ai, fake: FakeGateway) -> None:
    stream = await ai.run(LEGACY_MODEL, js({"prompt": "x y", "stream": True}))
    assert isinstance(stream, ReadableStream)
    raw = await stream.bytes()
    events = raw.decode().split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    frames = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert "".join(f["response"] for f in frames) == "echo: x y"
    assert fake.requests[-1]["body"]["stream"] is True


async def test_raw_response_is_not_unwrapped_nor_raised(ai: Ai) -> None:
    ok = await ai.run(LEGACY_MODEL, js({"prompt": "hi"}), js({"returnRawResponse": True}))
    assert isinstance(ok, Response) and ok.status == 200
    assert (await ok.json()).to_py()["result"]["response"] == "echo: hi"
    missing = await ai.run("@cf/nope/nothing", js({"prompt": "hi"}), js({"returnRawResponse": True}))
    assert missing.status == 400
    assert (await missing.json())["errors"][0]["code"] == 5007


async def test_options_become_headers_body_and_query(ai: Ai, fake: FakeGateway) -> None:
    gateway = {
        "id": "my-gw",
        "skipCache": True,
        "cacheTtl": 60,
        "metadata": {"user": "u1"},
        "retries": {"maxAttempts": 3, "backoff": "linear"},
    }
    await ai.run(
        LEGACY_MODEL,
        js({"prompt": "hi"}),
        js({"extraHeaders": {"x-session-affinity": "ses_1"}, "gateway": gateway, "tags": ["a:b", "c"]}),
    )
    headers = fake.requests[-1]["headers"]
    assert headers["x-session-affinity"] == "ses_1"
    assert headers["cf-aig-gateway-id"] == "my-gw"
    assert headers["cf-aig-skip-cache"] == "true"
    assert headers["cf-aig-cache-ttl"] == "60"
    assert json.loads(headers["cf-aig-metadata"]) == {"user": "u1"}
    assert headers["cf-aig-max-attempts"] == "3" and headers["cf-aig-backoff"] == "linear"
    assert headers["authorization"] == f"Bearer {TOKEN}"
    assert fake.requests[-1]["body"] == {"prompt": "hi"}

    queued = await ai.run(LEGACY_MODEL, js({"requests": [{"prompt": "a"}]}), js({"queueRequest": True}))
    assert queued.status == "queued" and queued.request_id
    assert fake.requests[-1]["query"] == {"queueRequest": "true"}


async def test_reject_if_busy_raises_3040(ai: Ai, fake: FakeGateway) -> None:
    with pytest.raises(InferenceUpstreamError) as caught:
        await ai.run(LEGACY_MODEL, js({"prompt": "hi"}), js({"rejectIfBusy": True}))
    assert fake.requests[-1]["body"]["options"] == {"rejectIfBusy": True}
    assert (caught.value.status, caught.value.code) == (429, 3040)


async def test_unknown_model_raises_5007(ai: Ai) -> None:
    with pytest.raises(InferenceUpstreamError) as caught:
        await ai.run("@cf/foo/bar", js({"prompt": "hi"}))
    error = caught.value
    assert (error.status, error.code) == (400, 5007)
    assert error.message == "AiError: AiError: No such model @cf/foo/bar or task"
    assert str(error) == "5007: AiError: AiError: No such model @cf/foo/bar or task"


async def test_unknown_model_raises_before_streaming(ai: Ai) -> None:
    with pytest.raises(InferenceUpstreamError) as caught:
        await ai.run("@cf/foo/bar", js({"prompt": "hi", "stream": True}))
    assert caught.value.code == 5007


async def test_bad_token_raises_10000(fake: FakeGateway) -> None:
    credentials = Credentials(
        api_base_url="http://fake-gateway/client/v4", api_token="wrong", account_id=ACCOUNT
    )
    async with CloudflareApi.make_client(httpx.ASGITransport(app=fake.app)) as client:
        ai = Ai(CloudflareApi(credentials, client))
        with pytest.raises(InferenceUpstreamError) as caught:
            await ai.run(LEGACY_MODEL, js({"prompt": "hi"}))
        with pytest.raises(InferenceUpstreamError) as caught_models:
            await ai.models()
    assert (caught.value.status, caught.value.code, caught.value.message) == (
        401,
        10000,
        "Authentication error",
    )
    assert caught_models.value.code == 10000


async def test_models_searches_the_catalog(ai: Ai, fake: FakeGateway) -> None:
    everything = await ai.models()
    kimi = await ai.models(js({"search": "kimi"}))
    assert [m.name for m in everything] == [e["name"] for e in fake.catalog]
    assert kimi.to_py() == [fake.catalog[0]]


async def test_map_inputs_are_refused(ai: Ai, fake: FakeGateway) -> None:
    with pytest.raises(TypeError, match="Object.fromEntries"):
        await ai.run(LEGACY_MODEL, to_js({"prompt": "hi"}))
    with pytest.raises(TypeError, match="gateway.id"):
        await ai.run(LEGACY_MODEL, js({"prompt": "hi"}), js({"gateway": {"skipCache": True}}))
    with pytest.raises(TypeError, match="tags"):
        await ai.run(LEGACY_MODEL, js({"prompt": "hi"}), js({"tags": ["bad tag!"]}))
    assert fake.requests == []


async def test_raw_streamed_response_keeps_the_sse_body(ai: Ai) -> None:
    raw = await ai.run(OPENAI_MODEL, js({"prompt": "s t", "stream": True}), js({"returnRawResponse": True}))
    assert isinstance(raw, Response) and raw.status == 200
    assert raw.headers["content-type"].startswith("text/event-stream") and "content-length" not in raw.headers
    assert isinstance(raw.body, ReadableStream)
    text = await raw.text()
    assert text.endswith("data: [DONE]\n\n") and '"content": "s "' in text


async def test_an_unreachable_gateway_is_one_clear_error() -> None:
    port = free_port()  # nothing listens there
    credentials = Credentials(
        api_base_url=f"http://127.0.0.1:{port}/client/v4", api_token=TOKEN, account_id=ACCOUNT
    )
    async with CloudflareApi.make_client() as client:
        ai = Ai(CloudflareApi(credentials, client))
        with pytest.raises(
            GatewayUnreachable, match=f"cannot reach http://127.0.0.1:{port}/client/v4/accounts/"
        ):
            await ai.run(LEGACY_MODEL, js({"prompt": "hi"}))
        with pytest.raises(JsException):  # what Worker code written for Cloudflare catches
            await ai.models()

# ruff: noqa: F811  (pytest fixtures imported by name)
"""`/ai/run` with the legacy Workers AI family, against scripted fake backends (wire format §1.3 a)."""

from __future__ import annotations

import base64
import io

import msgspec
from gateway_harness import LEGACY, Harness, harness  # noqa: F401  (fixture)
from PIL import Image


def sse_events(text: str) -> list[object]:
    frames = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [msgspec.json.decode(f) for f in frames[:-1]]


async def test_prompt_returns_response_and_usage_in_the_envelope(harness: Harness) -> None:
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}"), headers=harness.auth(), json={"prompt": "hello"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    assert body["result"]["response"] == "echo: hello"
    usage = body["result"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    sent = harness.last
    assert sent.sampling.max_tokens == 256  # the Workers AI default
    assert sent.messages is not None and sent.messages[-1].content == "hello"


async def post(h: Harness, body: object, model: str = LEGACY, **kw: object):  # type: ignore[no-untyped-def]
    return await h.http.post(h.path(f"/ai/run/{model}"), headers=h.auth(), json=body, **kw)


async def test_integers_written_as_whole_floats_are_integers(harness: Harness) -> None:
    """JSON Schema's `integer` admits `16.0`, and Workers AI clients are JavaScript (16.0 === 16);
    a fraction is still refused, naming the field."""
    raw = b'{"prompt": "hi", "max_tokens": 16.0, "top_k": 5e0, "seed": 7.0, "temperature": 1.0}'
    r = await harness.http.post(
        harness.path(f"/ai/run/{LEGACY}"),
        headers={**harness.auth(), "content-type": "application/json"},
        content=raw,
    )
    assert r.status_code == 200, r.text
    sampling = harness.last.sampling
    assert (sampling.max_tokens, sampling.top_k, sampling.seed, sampling.temperature) == (16, 5, 7, 1.0)
    r = await post(harness, {"prompt": "hi", "max_tokens": 16.5})
    assert r.status_code == 400 and "$.max_tokens" in r.json()["errors"][0]["message"]


async def test_messages_and_tool_results_reach_the_backend(harness: Harness) -> None:
    body = {
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Lisbon"}}],
            },
            {"role": "tool", "content": '{"temp": 21}', "tool_call_id": "abcdefghi"},
            {"role": "user", "content": "and now?"},
        ],
        "temperature": 0.2,
        "top_k": 5,
        "seed": 7,
    }
    r = await post(harness, body)
    assert r.status_code == 200, r.text
    assert r.json()["result"]["response"] == "echo[7]: and now?"
    sent = harness.last
    assert [m.role for m in sent.messages or []] == ["system", "user", "assistant", "tool", "user"]
    call = (sent.messages or [])[2].tool_calls[0]  # type: ignore[index]
    assert call.function.name == "get_weather" and msgspec.json.decode(call.function.arguments) == {
        "city": "Lisbon"
    }
    assert (sent.messages or [])[3].tool_call_id == "abcdefghi"
    assert (sent.sampling.temperature, sent.sampling.top_k, sent.sampling.seed) == (0.2, 5, 7)


async def test_stream_frames_carry_random_padding_and_a_usage_frame(harness: Harness) -> None:
    r = await post(harness, {"prompt": "stream me", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_events(r.text)
    text_frames = [f for f in frames if f["response"]]  # type: ignore[index]
    assert "".join(f["response"] for f in text_frames) == "echo: stream me"  # type: ignore[index]
    assert all(isinstance(f["p"], str) and f["p"] for f in text_frames)  # type: ignore[index]
    assert len({f["p"] for f in text_frames}) > 1  # random, not a constant  # type: ignore[index]
    last = frames[-1]
    assert last["response"] == "" and last["usage"]["total_tokens"] > 0  # type: ignore[index]
    assert last["usage"]["neurons"] > 0  # type: ignore[index]


async def test_tools_in_both_shapes_return_object_arguments(harness: Harness) -> None:
    params = {"type": "object", "properties": {"city": {"type": "string", "description": "City"}}}
    tools = [
        {"name": "get_weather", "description": "Weather", "parameters": params},
        {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": params}},
    ]
    r = await post(harness, {"messages": [{"role": "user", "content": "tool:"}], "tools": tools})
    assert r.status_code == 200, r.text
    calls = r.json()["result"]["tool_calls"]
    assert calls[0] == {"name": "get_weather", "arguments": {"city": "Lisbon"}}  # object, no id, no type
    sent = harness.last
    assert [t.name for t in sent.tools or []] == ["get_weather", "get_time"]
    streamed = sse_events((await post(harness, {"prompt": "tool:", "tools": tools, "stream": True})).text)
    with_calls = [f for f in streamed if "tool_calls" in f]  # type: ignore[operator]
    assert with_calls[0]["tool_calls"][1] == {"name": "get_weather", "arguments": {"city": "Porto"}}  # type: ignore[index]


async def test_json_mode_returns_the_parsed_object_and_refuses_to_stream(harness: Harness) -> None:
    fmt = {
        "type": "json_schema",
        "json_schema": {"type": "object", "properties": {"answer": {"type": "number"}}},
    }
    r = await post(harness, {"prompt": "json:", "response_format": fmt})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["response"] == {"answer": 42, "ok": True}
    sent = harness.last
    assert sent.response_format is not None and sent.response_format.json_schema == fmt["json_schema"]
    streamed = await post(harness, {"prompt": "json:", "response_format": fmt, "stream": True})
    assert streamed.status_code == 400 and "stream" in streamed.json()["errors"][0]["message"]
    broken = await post(harness, {"prompt": "not json", "response_format": {"type": "json_object"}})
    assert broken.status_code == 400 and "JSON Mode couldn't be met" in broken.json()["errors"][0]["message"]


async def test_json_mode_beside_tools_answers_a_call_with_the_call(harness: Harness) -> None:
    """JSON mode and tools offered: a model that calls a tool has no JSON to give; the answer is the
    call (it was a 400, "JSON Mode couldn't be met"), and a JSON answer is still parsed."""
    params = {"type": "object", "properties": {"city": {"type": "string"}}}
    tools = [{"name": "get_weather", "description": "Weather", "parameters": params}]
    body = {"tools": tools, "response_format": {"type": "json_object"}}
    r = await post(harness, {"messages": [{"role": "user", "content": "tool:"}], **body})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["tool_calls"][0] == {"name": "get_weather", "arguments": {"city": "Lisbon"}}
    answered = await post(harness, {"messages": [{"role": "user", "content": "json:"}], **body})
    assert answered.status_code == 200 and answered.json()["result"]["response"] == {"answer": 42, "ok": True}


async def test_invalid_fields_are_refused_naming_them(harness: Harness) -> None:
    cases = {
        "max_tokens": {"prompt": "x", "max_tokens": 0},
        "top_k": {"prompt": "x", "top_k": 51},
        "bogus": {"prompt": "x", "bogus": 1},
        "lora": {"prompt": "x", "lora": "my-adapter"},
        "prompt": {},
        "tool_calls[0]": {
            "messages": [{"role": "assistant", "content": "", "tool_calls": [{"function": "x"}]}]
        },
    }
    for field, body in cases.items():
        r = await post(harness, body)
        assert r.status_code == 400, (field, r.text)
        message = r.json()["errors"][0]["message"]
        assert field in message.lower() or "LoRa" in message, (field, message)
        assert r.json()["result"] is None and r.json()["success"] is False


async def test_image_on_a_model_without_vision_is_a_clear_400(harness: Harness) -> None:
    png = io.BytesIO()
    Image.new("RGB", (4, 4), "red").save(png, format="PNG")
    for image in (list(png.getvalue()), base64.b64encode(png.getvalue()).decode()):
        r = await post(harness, {"prompt": "what is this", "image": image})
        assert r.status_code == 400
        assert "does not support image inputs" in r.json()["errors"][0]["message"]
    r = await post(harness, {"prompt": "what is this", "image": [1, 2, 3]})
    assert r.status_code == 400 and "could not be decoded" in r.json()["errors"][0]["message"]


async def test_tenants_get_different_cache_salts(harness: Harness) -> None:
    await post(harness, {"prompt": "same prompt"})
    own = harness.last.tenant_salt
    url = harness.path(f"/ai/run/{LEGACY}", account=harness.free_account)
    r = await harness.http.post(url, headers=harness.auth(harness.free_token), json={"prompt": "same prompt"})
    assert r.status_code == 200
    assert harness.last.tenant_salt != own and len(own) == 64


async def test_a_json_mode_miss_is_metered_as_the_400_it_answered(harness: Harness) -> None:
    from gateway.usage import UsageRecord

    ledger = harness.services.ledger
    seen: list[UsageRecord] = []
    original = ledger.record
    ledger.record = lambda rec: (seen.append(rec), original(rec))[1]  # type: ignore[method-assign]
    try:
        broken = await post(harness, {"prompt": "not json", "response_format": {"type": "json_object"}})
    finally:
        ledger.record = original  # type: ignore[method-assign]
    assert broken.status_code == 400
    assert [r.status for r in seen] == [400]
    assert seen[0].completion_tokens > 0  # the tokens were spent and are counted

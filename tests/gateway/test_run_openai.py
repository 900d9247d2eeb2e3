# ruff: noqa: F811  (pytest fixtures imported by name)
"""`/ai/run` with the OpenAI-native family (Kimi, GLM): chat.completion in `result`, chunks plus
the Workers AI usage trailer, and every OpenAI field honoured or refused by name (§1.3 b, §1.5)."""

from __future__ import annotations

import base64
import io
from typing import Any

import msgspec
from gateway_harness import GLM, KIMI, Harness, harness  # noqa: F401  (fixture)
from PIL import Image
from test_run_legacy import sse_events

from gateway.backend_client import tenant_salt


async def post(h: Harness, body: object, model: str = KIMI, headers: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return await h.http.post(h.path(f"/ai/run/{model}"), headers={**h.auth(), **(headers or {})}, json=body)


def msgs(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def test_chat_completion_inside_the_envelope(harness: Harness) -> None:
    r = await post(harness, {"messages": msgs("think:hi"), "max_completion_tokens": 64})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert result["object"] == "chat.completion" and result["model"] == KIMI
    message = result["choices"][0]["message"]
    assert message["content"] == "echo: hi" and message["reasoning_content"] == "Let me think."
    assert message["role"] == "assistant" and message["refusal"] is None
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 4
    assert result["usage"]["completion_tokens_details"] == {"reasoning_tokens": 5}  # "Let me think." in 5
    assert harness.last.sampling.max_tokens == 64
    # no reasoning: the details still come, with 0 (as OpenAI sends them; they were left out)
    r = await post(harness, {"messages": msgs("hi"), "max_completion_tokens": 64})
    assert r.json()["result"]["usage"]["completion_tokens_details"] == {"reasoning_tokens": 0}


async def test_model_id_with_encoded_slashes_and_the_model_envelope(harness: Harness) -> None:
    encoded = KIMI.replace("/", "%2F")
    r = await harness.http.post(
        harness.path(f"/ai/run/{encoded}"), headers=harness.auth(), json={"prompt": "a"}
    )
    assert r.status_code == 200, r.text
    assert r.json()["result"]["choices"][0]["message"]["content"] == "echo: a"
    r = await harness.http.post(
        harness.path("/ai/run"),
        headers={**harness.auth(), "cf-aig-gateway-id": "default"},
        json={"model": GLM, "input": {"messages": msgs("b")}, "options": {"rejectIfBusy": True}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["result"]["model"] == GLM
    assert harness.last.reject_if_busy is True


async def test_envelope_reject_if_busy_with_a_non_object_inner_options_is_a_400(harness: Harness) -> None:
    r = await harness.http.post(
        harness.path("/ai/run"),
        headers=harness.auth(),
        json={
            "model": GLM,
            "input": {"messages": msgs("b"), "options": [1]},
            "options": {"rejectIfBusy": True},
        },
    )
    assert r.status_code == 400, r.text
    assert r.json()["errors"][0]["message"].endswith("'input.options' must be an object")


async def test_stream_is_chunks_then_the_workers_ai_trailer_then_done(harness: Harness) -> None:
    r = await post(harness, {"messages": msgs("think:stream"), "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_events(r.text)
    chunks, trailer = frames[:-1], frames[-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)  # type: ignore[index]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"  # type: ignore[index]
    deltas = [c["choices"][0]["delta"] for c in chunks]  # type: ignore[index]
    assert "".join(d.get("content") or "" for d in deltas) == "echo: stream"
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == "Let me think."
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"  # type: ignore[index]
    assert set(trailer) == {"response", "usage"} and trailer["response"] == ""  # type: ignore[index,arg-type]
    assert trailer["usage"]["total_tokens"] > 0 and trailer["usage"]["neurons"] > 0  # type: ignore[index]
    assert all(not ("response" in c and "choices" in c) for c in frames)  # one carrier per frame  # type: ignore[operator]


async def test_tool_calls_parallel_and_tool_choice(harness: Harness) -> None:
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    r = await post(harness, {"messages": msgs("tool:"), "tools": tools, "tool_choice": "required"})
    choice = r.json()["result"]["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    calls = choice["message"]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Lisbon"}', '{"city": "Porto"}']
    assert calls[0] == {
        "id": "call_abc123xyz",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Lisbon"}'},
    }
    sent = harness.last
    assert sent.tool_choice.mode == "required"
    r = await post(
        harness,
        {
            "messages": msgs("tool:"),
            "tools": tools,
            "parallel_tool_calls": False,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
        },
    )
    assert len(r.json()["result"]["choices"][0]["message"]["tool_calls"]) == 1
    assert harness.last.tool_choice.name == "get_weather"
    bad = await post(
        harness,
        {
            "messages": msgs("x"),
            "tools": tools,
            "tool_choice": {"type": "function", "function": {"name": "nope"}},
        },
    )
    assert bad.status_code == 400 and "tool_choice" in bad.json()["errors"][0]["message"]
    history = [
        {"role": "user", "content": "weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    assert (await post(harness, {"messages": history, "tools": tools})).status_code == 200
    sent = harness.last
    assert sent.messages[1].tool_calls[0].id == "call_1" and sent.messages[2].tool_call_id == "call_1"
    # a result must answer a call of the assistant message before it, as OpenAI requires
    for bad_history, index in (
        ([*history[:2], {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], 2),  # no such call
        ([history[0], {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], 1),  # no call at all
        ([*history, {"role": "user", "content": "and?"}, history[2]], 4),  # the calls were answered
    ):
        r = await post(harness, {"messages": bad_history, "tools": tools})
        message = r.json()["errors"][0]["message"]
        assert r.status_code == 400 and f"'messages[{index}].tool_call_id'" in message, r.text
    two = {
        **history[1],
        "tool_calls": [*history[1]["tool_calls"], {**history[1]["tool_calls"][0], "id": "call_2"}],
    }
    answered = [history[0], two, {"role": "tool", "tool_call_id": "call_2", "content": "rain"}, history[2]]
    assert (await post(harness, {"messages": answered, "tools": tools})).status_code == 200


async def test_n_fans_out_with_distinct_seeds_and_is_capped(harness: Harness) -> None:
    r = await post(harness, {"messages": msgs("hi"), "n": 3, "seed": 10})
    choices = r.json()["result"]["choices"]
    assert [c["message"]["content"] for c in choices] == ["echo[10]: hi", "echo[11]: hi", "echo[12]: hi"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    r = await post(harness, {"messages": msgs("hi"), "n": 2, "stream": True})
    chunks = sse_events(r.text)[:-1]
    assert {c["choices"][0]["index"] for c in chunks} == {0, 1}  # type: ignore[index]
    r = await post(harness, {"messages": msgs("hi"), "n": 9})
    assert r.status_code == 400 and "'n'" in r.json()["errors"][0]["message"]


async def test_reasoning_effort_uses_each_models_aliases(harness: Harness) -> None:
    cases = [
        (KIMI, {"reasoning_effort": "low"}, (True, "high")),
        (KIMI, {"reasoning_effort": "none"}, (False, None)),
        (KIMI, {"chat_template_kwargs": {"enable_thinking": False}}, (False, None)),
        (GLM, {"reasoning_effort": "xhigh"}, (True, "max")),
        (GLM, {"reasoning_effort": "medium"}, (True, "high")),
        (GLM, {"reasoning_effort": "minimal"}, (False, None)),
    ]
    for model, extra, expected in cases:
        r = await post(harness, {"messages": msgs("r"), **extra}, model=model)
        assert r.status_code == 200, (extra, r.text)
        sent = harness.last
        assert (sent.reasoning.enabled, sent.reasoning.effort) == expected, extra
    r = await post(harness, {"messages": msgs("r"), "reasoning_effort": "turbo"})
    assert r.status_code == 400 and "reasoning_effort" in r.json()["errors"][0]["message"]


async def test_fields_current_openai_sdks_send_are_accepted(harness: Harness) -> None:
    """`prompt_cache_key`, `safety_identifier` and `verbosity` (set by a caller of a current OpenAI
    SDK) were 400s "Object contains unknown field": accepted now, without effect, as the Responses
    API accepts the first two; a wrong `verbosity` is still a 400."""
    extra = {"prompt_cache_key": "session-7", "safety_identifier": "user-42", "verbosity": "low"}
    r = await post(harness, {"messages": msgs("x"), **extra})
    assert r.status_code == 200, r.text
    r = await post(harness, {"messages": msgs("x"), "verbosity": "loud"})
    assert r.status_code == 400 and "verbosity" in r.json()["errors"][0]["message"]


async def test_unserved_openai_fields_are_refused_by_name(harness: Harness) -> None:
    for field, value in {
        "audio": {"voice": "alloy", "format": "wav"},
        "logit_bias": {"50256": -100},
        "web_search_options": {},
        "modalities": ["text", "audio"],
        "requests": [{"prompt": "x"}],
    }.items():
        r = await post(harness, {"messages": msgs("x"), field: value})
        assert r.status_code == 400, field
        assert field in r.json()["errors"][0]["message"], (field, r.json())
    r = await post(
        harness,
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}],
                }
            ]
        },
    )
    assert r.status_code == 400 and "input_audio" in r.json()["errors"][0]["message"]


async def test_stop_seed_logprobs_and_penalties_are_honoured(harness: Harness) -> None:
    r = await post(
        harness,
        {
            "messages": msgs("logprobs"),
            "stop": "END",
            "seed": 3,
            "logprobs": True,
            "top_logprobs": 2,
            "presence_penalty": 0.5,
            "temperature": 0.3,
            "top_p": 0.9,
        },
    )
    assert r.status_code == 200, r.text
    sent = harness.last
    assert sent.sampling.stop == ["END"] and sent.sampling.seed == 3 and sent.sampling.logprobs
    assert (
        sent.sampling.top_logprobs,
        sent.sampling.presence_penalty,
        sent.sampling.temperature,
        sent.sampling.top_p,
    ) == (2, 0.5, 0.3, 0.9)
    choice = r.json()["result"]["choices"][0]
    content = choice["logprobs"]["content"]
    assert [c["token"] for c in content] == ["abc", "def", "\ufffd", "\ufffd"]  # "€" over two tokens
    assert content[0]["bytes"] == list(b"abc") and len(content[0]["top_logprobs"]) == 2
    assert content[0]["top_logprobs"][1]["bytes"] == list(b"zz")
    # each token's own bytes: joined, they rebuild the character its tokens split, as OpenAI's do
    assert bytes(x for c in content for x in c["bytes"]) == choice["message"]["content"].encode()
    assert choice["message"]["content"] == "abcdef€"
    body = {"messages": msgs("logprobs"), "logprobs": True, "top_logprobs": 2, "stream": True}
    streamed = await post(harness, body)
    chunks: list[Any] = sse_events(streamed.text)
    lps = [
        c["choices"][0]["logprobs"] for c in chunks if c.get("choices") and c["choices"][0].get("logprobs")
    ]
    assert [t for lp in lps for t in lp["content"]] == content  # every token, text or not
    r = await post(harness, {"messages": msgs("x"), "top_logprobs": 2})
    assert r.status_code == 400 and "logprobs" in r.json()["errors"][0]["message"]


async def test_images_as_data_uri_reach_a_vision_model_only(harness: Harness) -> None:
    png = io.BytesIO()
    Image.new("RGB", (8, 8), "blue").save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": uri}}]
    r = await post(harness, {"messages": [{"role": "user", "content": content}]})
    assert r.status_code == 200, r.text
    parts = harness.last.messages[0].content
    assert parts[1].data == png.getvalue() and parts[1].media_type == "image/png"
    r = await post(harness, {"messages": [{"role": "user", "content": content}]}, model=GLM)
    assert r.status_code == 400 and "does not support image inputs" in r.json()["errors"][0]["message"]


async def test_session_affinity_sticks_and_salt_comes_from_the_tenant(harness: Harness) -> None:
    a, b = harness.backends["kimi-k2.6"]
    for session in ("ses_1", "ses_2", "ses_3", "ses_4"):
        seen = set()
        for _ in range(3):
            before = (len(a.requests), len(b.requests))
            await post(harness, {"messages": msgs("s")}, headers={"x-session-affinity": session})
            seen.add("a" if len(a.requests) > before[0] else "b")
        assert len(seen) == 1, session
    salt = harness.last.tenant_salt
    assert salt == tenant_salt(harness.services.settings.server_secret, harness.account)
    r = await post(harness, {"messages": msgs("s"), "tenant_salt": "00" * 16})
    assert r.status_code == 400  # a client cannot pick its salt
    msgspec.json.decode(r.content)


async def test_a_prompt_cache_key_sticks_to_a_replica(harness: Harness) -> None:
    """OpenAI's `prompt_cache_key` (Chat Completions and the Responses API) routes as the
    `x-session-affinity` header does: the requests that share it meet one replica's prefix cache;
    keys spread over the replicas."""
    a, b = harness.backends["kimi-k2.6"]
    where: dict[str, set[str]] = {}
    for key in (
        f"k{i}" for i in range(16)
    ):  # all on one of two replicas: 2^-15 (rendezvous over random ports)
        for body, path in (
            ({"messages": msgs("s"), "prompt_cache_key": key}, None),
            ({"model": KIMI, "input": "s", "prompt_cache_key": key}, "/ai/v1/responses"),
        ):
            before = (len(a.requests), len(b.requests))
            if path is None:
                r = await post(harness, body)
            else:
                r = await harness.http.post(harness.path(path), headers=harness.auth(), json=body)
            assert r.status_code == 200, r.text
            where.setdefault(key, set()).add("a" if len(a.requests) > before[0] else "b")
    assert all(len(v) == 1 for v in where.values()), where
    assert {next(iter(v)) for v in where.values()} == {"a", "b"}


async def test_nesting_is_bounded(harness: Harness) -> None:
    deep: dict[str, object] = {"type": "object"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"x": deep}}
    tools = [{"type": "function", "function": {"name": "f", "parameters": deep}}]
    r = await post(harness, {"messages": msgs("x"), "tools": tools})
    assert r.status_code == 400 and "tools[0].parameters" in r.json()["errors"][0]["message"]
    bomb = (
        b'{"messages": [{"role": "user", "content": "x"}], "metadata": '
        + b"[" * 100_000
        + b"]" * 100_000
        + b"}"
    )
    r = await harness.http.post(harness.path(f"/ai/run/{KIMI}"), headers=harness.auth(), content=bomb)
    assert r.status_code == 400 and r.json()["errors"][0]["code"] == 5006


async def test_legacy_openai_fields_and_allowed_tools_map_onto_the_same_request(harness: Harness) -> None:
    fn = {"name": "get_weather", "description": "Weather", "parameters": {"type": "object"}}
    r = await post(
        harness,
        {
            "messages": [{"role": "developer", "content": "be terse"}, {"role": "user", "content": "tool:"}],
            "functions": [fn],
            "function_call": {"name": "get_weather"},
            "stop": ["a", "b"],
        },
    )
    assert r.status_code == 200, r.text
    sent = harness.last
    assert [m.role for m in sent.messages or []] == ["system", "user"]
    assert [t.name for t in sent.tools or []] == ["get_weather"]
    assert (sent.tool_choice.mode, sent.tool_choice.name) == ("function", "get_weather")  # type: ignore[union-attr]
    assert sent.sampling.stop == ["a", "b"]
    tools = [
        {"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
        for n in ("a", "b", "c")
    ]
    choice = {
        "type": "allowed_tools",
        "allowed_tools": {"mode": "required", "tools": [{"type": "function", "function": {"name": "b"}}]},
    }
    r = await post(harness, {"messages": msgs("x"), "tools": tools, "tool_choice": choice})
    assert r.status_code == 200, r.text
    assert [t.name for t in harness.last.tools or []] == ["b"] and harness.last.tool_choice.mode == "required"  # type: ignore[union-attr]
    for bad_choice in (
        {"type": "function", "function": "b"},
        {"type": "custom", "custom": {"name": "b"}},
        "sometimes",
    ):
        r = await post(harness, {"messages": msgs("x"), "tools": tools, "tool_choice": bad_choice})
        assert r.status_code == 400 and "tool_choice" in r.json()["errors"][0]["message"], bad_choice
    custom = [{"type": "custom", "custom": {"name": "lark", "format": {"type": "text"}}}]
    r = await post(harness, {"messages": msgs("x"), "tools": custom})
    assert r.status_code == 400 and "tools[0].type" in r.json()["errors"][0]["message"]


async def test_image_bytes_do_not_count_as_prompt_tokens_at_admission(harness: Harness) -> None:
    """A ~40 kB image under a 6,000 tokens-per-minute quota is admitted: its base64 is not ~13k tokens."""
    import numpy as np

    from schemas.admin import Quotas, TenantCreate, TokenCreate

    store = harness.services.store
    tenant = await store.create_tenant(TenantCreate(name="tpm", plan="paid"), actor="test")
    token = (await store.create_token(tenant.id, TokenCreate(name="t"), actor="test")).value
    await store.set_quotas(tenant.id, Quotas(tokens_per_minute=6000), actor="test")
    png = io.BytesIO()
    noise = np.random.default_rng(0).integers(0, 256, (110, 110, 3), dtype=np.uint8)
    Image.fromarray(noise).save(png, format="PNG")
    assert 30_000 < len(png.getvalue()) < 64 * 1024
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "what?"}, {"type": "image_url", "image_url": {"url": uri}}]
    r = await harness.http.post(
        harness.path(f"/ai/run/{KIMI}", account=tenant.id),
        headers=harness.auth(token),
        json={"messages": [{"role": "user", "content": content}], "max_tokens": 16},
    )
    assert r.status_code == 200, r.text


async def test_mistakes_a_newcomer_makes_get_errors_that_say_what_to_send(harness: Harness) -> None:
    """Workers AI's JSON-mode page puts a bare schema in `json_schema` (the older models' form);
    these models take OpenAI's `{name, schema}`: the 400 says so. The OpenAI route asks for
    `messages` alone (it takes no `prompt`)."""
    bare = {"type": "object", "properties": {"answer": {"type": "integer"}}, "required": ["answer"]}
    r = await post(
        harness, {"messages": msgs("json"), "response_format": {"type": "json_schema", "json_schema": bare}}
    )
    message = r.json()["errors"][0]["message"]
    assert r.status_code == 400 and '{"name": ..., "schema": <the JSON Schema>}' in message, message
    wrapped = {"type": "json_schema", "json_schema": {"name": "a", "schema": bare}}
    assert (await post(harness, {"messages": msgs("json"), "response_format": wrapped})).status_code == 200
    r = await harness.http.post(
        harness.path("/ai/v1/chat/completions"), headers=harness.auth(), json={"model": KIMI}
    )
    assert (
        r.status_code == 400
        and r.json()["errors"][0]["message"] == "AiError: Bad input: 'messages' is required"
    )

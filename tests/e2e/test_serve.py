# ruff: noqa: F811  (pytest fixtures imported by name)
"""End to end through `kumo serve`: the gateway in front of real `kumo backend` processes on the
CPU (tiny random checkpoints, so answers are gibberish: we check structure, limits and plumbing,
which is what a user of the API relies on)."""

from __future__ import annotations

import json
import stat

import httpx
import pytest

from tests.e2e.serve_process import GLM, KIMI, LEGACY, Kumo, sdk_client

pytestmark = pytest.mark.slow


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
        },
    },
}


def frames(text: str) -> list[dict]:  # type: ignore[type-arg]
    data = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


def run(kumo: Kumo, model: str, body: dict, **headers: str) -> httpx.Response:  # type: ignore[type-arg]
    return httpx.post(kumo.path(f"/ai/run/{model}"), headers={**kumo.auth, **headers}, json=body, timeout=120)


def test_legacy_family_through_a_real_backend(kumo: Kumo) -> None:
    r = run(kumo, LEGACY, {"prompt": "Hello there", "max_tokens": 6, "seed": 1})
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert isinstance(result["response"], str) and result["usage"]["completion_tokens"] == 6
    assert result["usage"]["prompt_tokens"] > 2
    streamed = frames(
        run(kumo, LEGACY, {"prompt": "Hello there", "max_tokens": 6, "seed": 1, "stream": True}).text
    )
    assert "".join(f["response"] for f in streamed) == result["response"]  # same seed, same text
    assert all("p" in f for f in streamed if f["response"])
    assert streamed[-1]["usage"]["completion_tokens"] == 6


def test_openai_family_on_ai_run_with_trailer(kumo: Kumo) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 5,
        "chat_template_kwargs": {"enable_thinking": False},
        "seed": 2,
    }
    r = run(kumo, GLM, body)
    assert r.status_code == 200, r.text
    result = r.json()["result"]
    assert result["object"] == "chat.completion" and result["model"] == GLM
    assert result["choices"][0]["message"]["reasoning_content"] is None
    assert result["usage"]["completion_tokens"] == 5
    streamed = frames(run(kumo, GLM, {**body, "stream": True}).text)
    chunks, trailer = streamed[:-1], streamed[-1]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == result["choices"][0]["message"]["content"]
    assert (
        trailer["response"] == ""
        and trailer["usage"]["completion_tokens"] == 5
        and trailer["usage"]["neurons"] > 0
    )


def test_openai_package_stream_tools_json_and_n(kumo: Kumo) -> None:
    client = sdk_client(kumo, timeout=120)
    stream = client.chat.completions.create(
        model=GLM,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 4
    tool = WEATHER_TOOL
    called = client.chat.completions.create(
        model=GLM,
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=40,
        seed=3,
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert called.choices[0].finish_reason == "tool_calls"
    call = (called.choices[0].message.tool_calls or [])[0]
    assert call.function.name == "get_weather" and isinstance(
        json.loads(call.function.arguments)["city"], str
    )  # type: ignore[union-attr]
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    shaped = client.chat.completions.create(
        model=GLM,
        messages=[{"role": "user", "content": "A number"}],
        max_tokens=30,
        n=2,
        seed=4,
        response_format={"type": "json_schema", "json_schema": {"name": "num", "schema": schema}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )
    assert len(shaped.choices) == 2
    for choice in shaped.choices:
        assert 0 <= json.loads(choice.message.content or "")["n"] <= 9


def test_logprob_bytes_rebuild_characters_split_over_tokens(kumo: Kumo) -> None:
    """Through the `openai` package: a reply (forced by a schema) whose characters the trained GLM's
    tokenizer splits over tokens; the logprobs' `bytes`, joined, are the reply's UTF-8, streamed or not,
    while those tokens' text alone is U+FFFD."""
    client = sdk_client(kumo, timeout=120)
    schema = {"type": "string", "enum": ["日本語 €"]}
    request = {
        "model": GLM,
        "messages": [{"role": "user", "content": "Say it"}],
        "max_tokens": 30,
        "logprobs": True,
        "top_logprobs": 2,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
        "extra_body": {"chat_template_kwargs": {"enable_thinking": False}},
    }
    whole = client.chat.completions.create(**request)  # type: ignore[call-overload]
    content = whole.choices[0].message.content
    assert json.loads(content) == "日本語 €"
    tokens = whole.choices[0].logprobs.content
    assert sum(t.token == "\ufffd" for t in tokens) >= 2
    assert bytes(x for t in tokens for x in t.bytes) == content.encode()
    streamed = [c for c in client.chat.completions.create(**request, stream=True) if c.choices]  # type: ignore[call-overload]
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == content
    pieces = [t for c in streamed if c.choices[0].logprobs for t in c.choices[0].logprobs.content or []]
    assert bytes(x for t in pieces for x in t.bytes) == content.encode()


def test_legacy_json_mode_returns_an_object(kumo: Kumo) -> None:
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    r = run(
        kumo,
        LEGACY,
        {
            "prompt": "Answer",
            "max_tokens": 20,
            "response_format": {"type": "json_schema", "json_schema": schema},
        },
    )
    assert r.status_code == 200, r.text
    assert isinstance(r.json()["result"]["response"]["ok"], bool)


def test_context_window_and_catalog_come_from_the_backend(kumo: Kumo) -> None:
    served = kumo.data_dir / "checkpoints" / "glm-5.2-nano-int4-g32"  # converted on first start
    config = json.loads((served / "config.json").read_text())
    window = config["max_position_embeddings"]
    models = httpx.get(kumo.path("/ai/models/search"), headers=kumo.auth).json()["result"]
    glm = next(m for m in models if m["name"] == GLM)
    props = {p["property_id"]: p["value"] for p in glm["properties"]}
    # the served configuration: INT4 experts, FP8 KV
    assert props["context_window"] == str(window) and props["weights"] == "int4-w4a16"
    assert props["kv_cache_dtype"] == "fp8_e4m3"
    r = run(kumo, GLM, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": window})
    assert r.status_code == 413 and r.json()["errors"][0]["code"] == 5021
    assert f"context window limit ({window})" in r.json()["errors"][0]["message"]


def test_the_backends_logs_are_the_owners_alone(kumo: Kumo) -> None:
    """The data dir's files are 0600; the backends' logs (a traceback may quote a prompt) sit in a
    folder only the owner may open."""
    logs = kumo.data_dir / "logs"
    assert stat.S_IMODE(logs.stat().st_mode) == 0o700 and any(logs.glob("*.log"))


@pytest.mark.parametrize(
    ("model", "window", "max_tokens"), [(KIMI, 262_144, 250_000), (GLM, 202_752, 200_000)]
)
def test_the_advertised_window_is_served(kumo: Kumo, model: str, window: int, max_tokens: int) -> None:
    """A short prompt with a huge `max_tokens` inside the advertised window is admitted (the CPU
    pool is sized for it): the stream starts, and we hang up after its first tokens."""
    models = httpx.get(kumo.path("/ai/models/search"), headers=kumo.auth).json()["result"]
    props = {
        p["property_id"]: p["value"] for p in next(m for m in models if m["name"] == model)["properties"]
    }
    assert props["context_window"] == str(window)
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": max_tokens, "stream": True}
    with httpx.stream("POST", kumo.path(f"/ai/run/{model}"), headers=kumo.auth, json=body, timeout=120) as r:
        assert r.status_code == 200
        events = []
        for line in r.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line.removeprefix("data: ")))
            if len(events) >= 3:
                break
    assert events and events[0]["object"] == "chat.completion.chunk"
    over = run(kumo, model, {**body, "stream": False, "max_tokens": window})
    assert over.status_code == 413 and over.json()["errors"][0]["code"] == 5021


def test_prefix_cache_hits_with_session_affinity(kumo: Kumo) -> None:
    long = "Tell me about the history of the city and its rivers, bridges and old harbours. " * 4
    body = {"messages": [{"role": "user", "content": long}], "max_tokens": 2}
    first = run(kumo, GLM, body, **{"x-session-affinity": "ses_e2e"}).json()["result"]["usage"]
    second = run(kumo, GLM, body, **{"x-session-affinity": "ses_e2e"}).json()["result"]["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"] > 32
    assert second["prompt_tokens_details"]["cached_tokens"] >= 16


def test_the_choices_of_one_request_share_its_prompt(kumo: Kumo) -> None:
    """n = 3: the first choice goes alone, the others once it has its first token, from its cached
    prompt pages. Billed: the prompt once, plus what each later choice's cache did not serve (less
    than a page each), not three prompts (routed at once, each prefilled the whole prompt)."""
    long = "Name the rivers, bridges and harbours of an old port city, one by one, in order. " * 4
    one = run(kumo, GLM, {"messages": [{"role": "user", "content": long + "(a)"}], "max_tokens": 2})
    three = run(kumo, GLM, {"messages": [{"role": "user", "content": long + "(b)"}], "max_tokens": 2, "n": 3})
    single, shared = one.json()["result"]["usage"], three.json()["result"]["usage"]
    assert len(three.json()["result"]["choices"]) == 3 and single["prompt_tokens"] > 48
    assert shared["prompt_tokens"] < single["prompt_tokens"] + 2 * 32, (single, shared)


def test_kimi_with_an_image(kumo: Kumo) -> None:
    import base64
    import io

    from PIL import Image

    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(png.getvalue()).decode()
    content = [{"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": uri}}]
    r = run(kumo, KIMI, {"messages": [{"role": "user", "content": content}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["result"]["usage"]["prompt_tokens"] > 10


def test_reasoning_effort_levels_through_the_real_template(kumo: Kumo) -> None:
    for effort in ("max", "high", "none", "low"):
        r = run(
            kumo,
            GLM,
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "reasoning_effort": effort},
        )
        assert r.status_code == 200, (effort, r.text)
        message = r.json()["result"]["choices"][0]["message"]
        if effort == "none":
            assert message["reasoning_content"] is None


def test_a_tool_round_trip(kumo: Kumo) -> None:
    client = sdk_client(kumo, timeout=120)
    tool = WEATHER_TOOL
    messages: list[dict] = [{"role": "user", "content": "Weather in Lisbon?"}]  # type: ignore[type-arg]
    first = client.chat.completions.create(
        model=GLM, messages=messages, tools=[tool], max_tokens=60, seed=5,  # type: ignore[arg-type,list-item]
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    calls = first.choices[0].message.tool_calls or []
    assert first.choices[0].finish_reason == "tool_calls" and calls
    messages.append(first.choices[0].message.model_dump(exclude_none=True))
    messages += [{"role": "tool", "tool_call_id": c.id, "content": '{"temp_c": 21}'} for c in calls]
    second = client.chat.completions.create(
        model=GLM, messages=messages, tools=[tool], max_tokens=4,  # type: ignore[arg-type,list-item]
        extra_body={"chat_template_kwargs": {"enable_thinking": False}},
    )  # fmt: skip
    assert second.usage is not None and second.usage.prompt_tokens > first.usage.prompt_tokens  # type: ignore[union-attr]


def test_the_trained_glm_calls_the_weather_tool_with_the_city(kumo: Kumo) -> None:
    """The default GLM 5.2 is the trained nano model (INT4 experts, FP8 KV): offered a weather tool
    among others, it calls it with the city the user named (towns of its generated world, which its
    training states as facts; the questions themselves are not training items)."""
    from models.recipes.tasks import TOOLS
    from models.recipes.world import make_world

    tools = [t for t in TOOLS if t["name"] in ("send_message", "get_weather", "set_timer")]
    towns = sorted(make_world(0).regions)[:3]
    for town in towns:
        body = {"messages": [{"role": "user", "content": f"What's the weather in {town}?"}], "tools": tools,
                "temperature": 0}  # fmt: skip
        r = run(kumo, GLM, body)
        assert r.status_code == 200, r.text
        message = r.json()["result"]["choices"][0]["message"]
        calls = [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]
        ]
        assert calls == [("get_weather", {"city": town})], (town, message)


def test_a_tool_call_nobody_offered_never_reaches_the_answer(kumo: Kumo) -> None:
    """Asked about the weather with no tools offered, the trained GLM opens a call to its training's
    `get_weather` unless its markers are banned (a probe, 2026-12-07: `content` came back
    `get_weather\ncity\nTokyo Heokyo\n`, the markers stripped): no trace of a call, no tool_calls."""
    for city in ("Tokyo", "Lisbon", "Nairobi"):
        body = {"messages": [{"role": "user", "content": f"Weather in {city}?"}], "max_tokens": 120,
                "temperature": 0}  # fmt: skip
        r = run(kumo, GLM, body)
        assert r.status_code == 200, r.text
        choice = r.json()["result"]["choices"][0]
        content = choice["message"]["content"] or ""
        assert "get_weather" not in content and "\ncity\n" not in content, (city, choice)
        assert not choice["message"].get("tool_calls") and choice["finish_reason"] in ("stop", "length"), (
            choice
        )


def test_a_schema_with_no_finite_value_is_an_error_not_an_answer(kumo: Kumo) -> None:
    """An object that requires itself has no complete JSON value: compiled lazily, its grammar dead-ends
    after `{"` (the probe of 2026-12-07: a 200, `content` `{"`, `finish_reason: stop`); the request
    fails with the reason instead. One with no value from its first token is refused up front."""
    recursive = {
        "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}, "required": ["c"]}},
        "$ref": "#/$defs/n",
    }
    for schema in (recursive, {"$ref": "#"}):
        body = {"messages": [{"role": "user", "content": "Give me JSON."}], "max_tokens": 40,
                "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": schema}}}  # fmt: skip
        r = run(kumo, GLM, body)
        assert r.status_code == 400, r.text
        assert "admits no complete value" in r.text or "cannot be satisfied" in r.text, r.text


def test_the_trained_glm_solves_two_step_word_problems(kumo: Kumo) -> None:
    """The default GLM 5.2 answers held-out two-step word problems (gsm-nano tier 1: numbers up to 10,
    `<think>` steps, then "The answer is N."). Measured through this path on 2026-12-02: 9 of these 20
    right for the two-stage model, 10 after the reading stages (chance: 0); a clear drop below 7 means the
    model or the serving path broke."""
    from concurrent.futures import ThreadPoolExecutor

    from models.recipes.build import item, split_seeds
    from models.recipes.world import make_world

    world = make_world(0)
    problems = [
        p
        for p in (item("gsm-nano", s, world) for s in split_seeds("test", "gsm-nano", 200))
        if p["tier"] == 1
    ]

    def answer(problem: dict) -> str:  # type: ignore[type-arg]
        body = {
            "messages": [{"role": "user", "content": problem["prompt"]}],
            "temperature": 0,
            "max_tokens": 160,
        }
        r = run(kumo, GLM, body)
        assert r.status_code == 200, r.text
        return r.json()["result"]["choices"][0]["message"]["content"] or ""

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(answer, problems[:20]))
    right = [f"The answer is {p['answer']}." in a for p, a in zip(problems, answers, strict=False)]
    assert sum(right) >= 7, [
        (p["prompt"], a) for p, a, ok in zip(problems, answers, right, strict=False) if not ok
    ]


def test_the_trained_kimi_names_the_colour_of_a_drawn_shape(kumo: Kumo) -> None:
    """The default Kimi K2.6 sees colour: held-out drawings of one shape (image-qa test seeds), sent as
    PNG data URIs through the public API, asked "What colour is the <shape>?". Four colours: chance is
    5 of 20. Measured through this path (INT4 experts, FP8 KV) after the vision stage of 2026-12-02
    (models/README.md): 20 of these 20 (14 after its first half), again 20 with the vision stage redone after
    the reading stage (15 before it); the model before the first vision stage said "red" to all 20 (5 right)."""
    import base64
    from concurrent.futures import ThreadPoolExecutor

    from models.recipes.build import item, split_seeds
    from models.recipes.images import COLOURS, render
    from models.recipes.world import make_world

    world = make_world(0)
    questions = [
        q
        for q in (item("image-qa", s, world) for s in split_seeds("test", "image-qa", 600))
        if len(q["image_spec"]) == 1 and q["prompt"].startswith("What colour")
    ][:20]
    assert len(questions) == 20

    def answer(q: dict) -> str:  # type: ignore[type-arg]
        uri = "data:image/png;base64," + base64.b64encode(render(q["image_spec"])).decode()
        content = [{"type": "image_url", "image_url": {"url": uri}}, {"type": "text", "text": q["prompt"]}]
        body = {"messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 48}
        r = run(kumo, KIMI, body)
        assert r.status_code == 200, r.text
        return (r.json()["result"]["choices"][0]["message"]["content"] or "").lower()

    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(answer, questions))
    named = [[c for c in sorted(COLOURS) if c in a] for a in answers]
    right = [n == [q["answer"]] for q, n in zip(questions, named, strict=True)]
    assert sum(right) >= 14, [(q["answer"], a) for q, a in zip(questions, answers, strict=True)]


def test_the_ready_banners_example_runs_on_the_readmes_model(kumo: Kumo) -> None:
    """The banner's curl names the README's example model (the text-only GLM 5.2: a first-hour
    probe's first "Hello" to the nano Kimi, the catalog's first entry, came back as noise), and
    answers as printed."""
    line = next(x for x in kumo.printed.splitlines() if "curl -s $KUMO_URL" in x)
    assert line.strip().endswith(f"/ai/run/{GLM} \\"), line
    r = httpx.post(kumo.path(f"/ai/run/{GLM}"), headers=kumo.auth, json={"prompt": "Hello"}, timeout=120)
    result = r.json()["result"]  # GLM 5.2 answers /ai/run in its family's shape: a chat completion
    assert r.status_code == 200 and result["object"] == "chat.completion", r.text
    assert result["choices"][0]["message"]["content"] or result["choices"][0]["message"]["reasoning_content"]

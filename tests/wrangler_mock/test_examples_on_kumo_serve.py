# ruff: noqa: F811  (the session's kumo fixture is imported by name)
"""End to end: `kumo serve` (real CPU backends, tiny random checkpoints), `wrangler-mock dev` serving
each example Worker as a user would start it, and HTTP requests to the Workers.

The checkpoints are random, so answers are gibberish: the tests check what a Worker author relies
on (shapes, token counts, streams that match the non-streamed answer under one seed, tool calls
that name an offered tool with valid arguments, the prefix cache reached through the forwarded
session header) and that Workers AI errors reach the Worker with their codes. The gateway is the
e2e suite's one `kumo serve` for the session (tests/e2e/serve_process.py).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from PIL import Image
from wm_support import EXAMPLES
from wrangler_mock.cli import main

from tests.child import dies_with_pytest
from tests.e2e.serve_process import GLM, KIMI, Kumo

pytestmark = pytest.mark.slow
WRANGLER_MOCK = Path(sys.executable).with_name("wrangler-mock")
TIMEOUT = 120


def frames(text: str) -> list[dict]:  # type: ignore[type-arg]
    data = [event.removeprefix("data: ") for event in text.split("\n\n") if event.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


@contextmanager
def dev(kumo: Kumo, example: str, *args: str, token: str | None = None) -> Iterator[str]:
    """`wrangler-mock dev` on an example, pointed at kumo through the environment; yields its URL."""
    env = {
        **os.environ,
        "CLOUDFLARE_API_BASE_URL": f"{kumo.url}/client/v4",
        "CLOUDFLARE_API_TOKEN": token or kumo.token,
        "CLOUDFLARE_ACCOUNT_ID": kumo.account,
    }
    config = EXAMPLES / example / "wrangler.toml"
    command = [str(WRANGLER_MOCK), "dev", "-c", str(config), "--port", "0", *args]
    process = subprocess.Popen(
        command,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=dies_with_pytest(),
    )
    try:
        assert process.stdout is not None
        url = next((line.split()[-1] for line in process.stdout if line.startswith("Ready on ")), None)
        assert url, f"wrangler-mock dev {example} did not start"
        yield url
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(scope="module")
def chat(kumo: Kumo) -> Iterator[str]:
    with dev(kumo, "chat") as url:
        yield url


def test_chat_worker(chat: str) -> None:
    body = {"prompt": "Hello there", "max_tokens": 6, "seed": 1}
    answered = httpx.post(chat, json=body, timeout=TIMEOUT)
    assert answered.status_code == 200, answered.text
    result = answered.json()
    assert isinstance(result["reply"], str)
    assert 1 <= result["usage"]["completion_tokens"] <= 6 and result["usage"]["prompt_tokens"] > 2

    streamed = httpx.post(chat, json={**body, "stream": True}, timeout=TIMEOUT)
    assert streamed.headers["content-type"].startswith("text/event-stream")
    chunks, trailer = frames(streamed.text)[:-1], frames(streamed.text)[-1]
    deltas = [c["choices"][0]["delta"] for c in chunks if c.get("choices")]
    assert "".join(d.get("content") or "" for d in deltas) == result["reply"]  # one seed, one answer
    assert "".join(d.get("reasoning_content") or "" for d in deltas) == (result["reasoning"] or "")
    assert (
        trailer["response"] == ""
        and trailer["usage"]["completion_tokens"] == result["usage"]["completion_tokens"]
    )


def test_chat_worker_forwards_session_affinity_to_the_prefix_cache(chat: str) -> None:
    long = "Tell me about the history of the city and its rivers, bridges and old harbours. " * 4
    body = {"prompt": long, "max_tokens": 2}
    headers = {"x-session-affinity": "ses_wrangler_mock"}
    first = httpx.post(chat, json=body, headers=headers, timeout=TIMEOUT).json()["usage"]
    second = httpx.post(chat, json=body, headers=headers, timeout=TIMEOUT).json()["usage"]
    assert second["prompt_tokens"] == first["prompt_tokens"] > 32
    assert second["prompt_tokens_details"]["cached_tokens"] >= 16


RATES_TO_USD = {"USD": 1.0, "EUR": 1.1, "GBP": 1.27, "JPY": 0.0067}  # the example's stand-in rates


def expected_result(name: str, arguments: dict) -> dict:  # type: ignore[type-arg]
    """What the example's stand-in tools answer, worked out here from their documented rules."""
    if name == "get_weather":
        city, unit = arguments["city"], arguments.get("unit", "celsius")
        celsius = sum(map(ord, city)) % 30
        temperature = celsius if unit == "celsius" else round(celsius * 9 / 5 + 32)
        return {
            "city": city,
            "temperature": temperature,
            "unit": unit,
            "sky": ["sunny", "cloudy", "rainy"][len(city) % 3],
        }
    rate = RATES_TO_USD[arguments["from"]] / RATES_TO_USD[arguments["to"]]
    return {"result": round(arguments["amount"] * rate, 2), "currency": arguments["to"]}


def test_tool_worker(kumo: Kumo) -> None:
    """A forced call's arguments follow the tool's schema; the Worker runs it and asks again.

    Random weights can spend the whole budget inside a JSON string, so seeds are tried until one
    call completes (about half do); every answer on the way must still be well formed.
    """
    with dev(kumo, "tools", "--var", f"MODEL:{GLM}") as url:
        for seed in range(1, 11):
            body = {
                "prompt": "What's the weather in Oslo?",
                "tool_choice": "required",
                "max_tokens": 256,
                "seed": seed,
            }
            response = httpx.post(url, json=body, timeout=TIMEOUT)
            assert response.status_code == 200, response.text
            assert isinstance(response.json()["reply"], str)
            if response.json()["tool_calls"]:
                break
    calls = response.json()["tool_calls"]
    assert calls, "no forced tool call completed in 10 seeds"
    for call in calls:
        if call["name"] == "get_weather":
            assert set(call["arguments"]) <= {"city", "unit"} and len(call["arguments"]["city"]) <= 40
        else:
            assert call["name"] == "convert_currency"
            assert set(call["arguments"]) == {"amount", "from", "to"}
        assert call["result"] == expected_result(call["name"], call["arguments"])


def test_image_worker(kumo: Kumo) -> None:
    png = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(png, format="PNG")
    with dev(kumo, "image") as url:
        response = httpx.post(
            f"{url}/?q=What+colour+is+it%3F",
            content=png.getvalue(),
            headers={"content-type": "image/png"},
            timeout=TIMEOUT,
        )
        text_only = httpx.post(url, json={"q": 1}, timeout=TIMEOUT)
        form = httpx.post(url, files={"image": ("red.png", png.getvalue(), "image/png")}, timeout=TIMEOUT)
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["answer"], str) and body["bytes"] == len(png.getvalue())
    assert body["usage"]["prompt_tokens"] > 10  # the image's tokens reached the model
    assert text_only.status_code == 415
    assert form.status_code == 200, form.text
    assert form.json()["bytes"] == body["bytes"] and form.json()["usage"]["prompt_tokens"] > 10


def test_unknown_model_and_bad_token_reach_the_worker_as_workers_ai_errors(kumo: Kumo) -> None:
    with dev(kumo, "chat", "--var", "MODEL:@cf/foo/bar") as url:
        unknown = httpx.post(url, json={"prompt": "hi"}, timeout=TIMEOUT)
    assert unknown.status_code == 502
    assert (
        unknown.json()["error"].startswith("5007: ")
        and "No such model @cf/foo/bar" in unknown.json()["error"]
    )
    with dev(kumo, "chat", token="not-a-real-token") as url:
        denied = httpx.post(url, json={"prompt": "hi"}, timeout=TIMEOUT)
    assert denied.status_code == 502 and denied.json()["error"].startswith("10000: ")


def test_ai_commands(
    kumo: Kumo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CLOUDFLARE_API_BASE_URL", f"{kumo.url}/client/v4")
    monkeypatch.setenv("CLOUDFLARE_API_TOKEN", kumo.token)
    monkeypatch.delenv("CLOUDFLARE_ACCOUNT_ID", raising=False)  # found through /memberships
    assert main(["ai", "models", "--json"]) == 0
    names = [m["name"] for m in json.loads(capsys.readouterr().out)]
    assert KIMI in names and GLM in names
    assert main(["ai", "run", GLM, "--prompt", "Hi", "--max-tokens", "4", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["object"] == "chat.completion" and result["usage"]["completion_tokens"] <= 4
    assert main(["ai", "run", GLM, "--prompt", "Hi", "--max-tokens", "4", "--stream"]) == 0
    assert capsys.readouterr().out.endswith("\n")
    assert main(["ai", "run", "@cf/foo/bar", "--prompt", "Hi"]) == 1
    assert "[code: 5007]" in capsys.readouterr().err

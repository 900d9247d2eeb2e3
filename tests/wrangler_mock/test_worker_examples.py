"""The three example Workers, served in-process with env.AI answered by the fake gateway."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
import zlib
from dataclasses import replace
from pathlib import Path

from fake_workers_ai import LEGACY_MODEL, OPENAI_MODEL, FakeGateway
from wm_support import EXAMPLES, served_worker
from wrangler_mock.config import WranglerConfig
from wrangler_mock.settings import Credentials


def parse_sse(text: str) -> list[str]:
    """`data:` payloads of an event stream, per the SSE spec (events end with a blank line)."""
    return [event.removeprefix("data: ") for event in text.split("\n\n") if event.startswith("data: ")]


def tiny_png(width: int = 3, height: int = 2) -> bytes:
    """A valid RGB PNG built by hand (signature, IHDR, IDAT, IEND)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes([200, 30, 30]) * width for _ in range(height))
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(rows))
        + chunk(b"IEND", b"")
    )


async def test_chat_worker_answers_and_forwards_session(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "chat" / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post(
            "/", json={"prompt": "Hello there"}, headers={"x-session-affinity": "ses_42"}
        )
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json()["reply"] == "echo: Hello there" and response.json()["reasoning"] is None
    assert response.json()["usage"]["prompt_tokens"] == 7
    sent = fake.requests[-1]
    assert sent["model"] == OPENAI_MODEL
    assert sent["headers"]["x-session-affinity"] == "ses_42"
    assert sent["body"]["messages"][0] == {"role": "system", "content": "You are a small, helpful assistant."}
    assert sent["body"]["max_tokens"] == 64 and "seed" not in sent["body"]


async def test_chat_worker_passes_sampling_on_and_reports_errors(
    fake: FakeGateway, credentials: Credentials
) -> None:
    config = WranglerConfig.load(EXAMPLES / "chat" / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        await worker.post("/", json={"prompt": "x", "seed": 5, "max_tokens": 3, "temperature": 0, "junk": 1})
        assert {
            k: fake.requests[-1]["body"].get(k) for k in ("seed", "max_tokens", "temperature", "junk")
        } == {
            "seed": 5,
            "max_tokens": 3,
            "temperature": 0,
            "junk": None,
        }
    broken = replace(config, vars={**config.vars, "MODEL": "@cf/nope/none"})
    async with served_worker(broken, credentials, fake) as worker:
        response = await worker.post("/", json={"prompt": "x"})
        streamed = await worker.post("/", json={"prompt": "x", "stream": True})
    assert response.status_code == 502 == streamed.status_code
    assert response.json() == {"error": "5007: AiError: AiError: No such model @cf/nope/none or task"}


async def test_chat_worker_streams_sse_through(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "chat" / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post("/", json={"prompt": "one two three", "stream": True})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = parse_sse(response.text)
    assert payloads[-1] == "[DONE]"
    frames = [json.loads(p) for p in payloads[:-1]]
    text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f.get("choices"))
    assert text == "echo: one two three"
    assert any("p" in f for f in frames)
    assert frames[-1]["response"] == "" and frames[-1]["usage"]["completion_tokens"] == 4


async def test_chat_worker_on_a_legacy_model(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "chat" / "wrangler.toml")
    config = replace(config, vars={**config.vars, "MODEL": LEGACY_MODEL})
    async with served_worker(config, credentials, fake) as worker:
        plain = await worker.post("/", json={"messages": [{"role": "user", "content": "hi"}]})
        streamed = await worker.post("/", json={"prompt": "a b", "stream": True})
    assert plain.json()["reply"] == "echo: hi"
    frames = [json.loads(p) for p in parse_sse(streamed.text)[:-1]]
    assert "".join(f["response"] for f in frames) == "echo: a b"


async def test_chat_worker_rejects_empty_body(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "chat" / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post("/", json={})
        get = await worker.get("/")
    assert response.status_code == 400
    assert get.status_code == 405
    assert fake.requests == []


async def test_tool_worker_runs_the_tool_and_asks_again(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "tools" / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post("/", json={"prompt": "What's the weather in Oslo?"})
    assert response.status_code == 200
    # the example's stand-in weather service: sum of code points mod 30, sky by name length
    expected = {"city": "Oslo", "temperature": sum(map(ord, "Oslo")) % 30, "unit": "celsius", "sky": "cloudy"}
    body = response.json()
    assert body["tool_calls"] == [{"name": "get_weather", "arguments": {"city": "Oslo"}, "result": expected}]
    assert body["reply"] == f"Done: {json.dumps(expected)}."
    first, second = fake.requests
    assert [t["function"]["name"] for t in first["body"]["tools"]] == ["get_weather", "convert_currency"]
    assert first["body"]["tool_choice"] == "auto" and "tool_choice" not in second["body"]
    assistant, tool = second["body"]["messages"][1:]
    assert assistant["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    assert tool["role"] == "tool" and tool["tool_call_id"] == assistant["tool_calls"][0]["id"]
    assert json.loads(tool["content"]) == expected


async def test_tool_worker_without_a_tool_call(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "tools" / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post("/", json={"prompt": "Hello!"})
    assert response.json() == {"reply": "echo: Hello!", "tool_calls": []}
    assert len(fake.requests) == 1


async def test_image_worker_forwards_the_upload(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "image" / "wrangler.toml")
    png = tiny_png()
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post(
            "/?q=What+colour+is+the+square%3F", content=png, headers={"content-type": "image/png"}
        )
        wrong_type = await worker.post("/", content=b"GIF89a", headers={"content-type": "text/plain"})
    assert response.status_code == 200
    digest = hashlib.sha256(png).hexdigest()[:16]
    assert response.json() == {
        "answer": f"image/png;base64 {len(png)} bytes sha256:{digest} | What colour is the square?",
        "bytes": len(png),
        "usage": {"prompt_tokens": 7, "completion_tokens": 10, "total_tokens": 17},
    }
    part = fake.requests[-1]["body"]["messages"][0]["content"][0]
    assert base64.b64decode(part["image_url"]["url"].split(",", 1)[1]) == png
    assert wrong_type.status_code == 415


async def test_image_worker_takes_a_form_upload(fake: FakeGateway, credentials: Credentials) -> None:
    config = WranglerConfig.load(EXAMPLES / "image" / "wrangler.toml")
    png = tiny_png(5, 4)
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.post(
            "/", files={"image": ("shape.png", png, "image/png")}, data={"question": "How many shapes?"}
        )
        no_file = await worker.post(
            "/", data={"question": "?"}, files={"other": ("x.txt", b"x", "text/plain")}
        )
    digest = hashlib.sha256(png).hexdigest()[:16]
    assert response.status_code == 200, response.text
    assert (
        response.json()["answer"] == f"image/png;base64 {len(png)} bytes sha256:{digest} | How many shapes?"
    )
    assert no_file.status_code == 415


async def test_uncaught_binding_error_is_a_500_naming_the_code(
    fake: FakeGateway, credentials: Credentials, tmp_path: Path
) -> None:
    (tmp_path / "entry.py").write_text(
        "from workers import Response, WorkerEntrypoint\n"
        "class Default(WorkerEntrypoint):\n"
        "    async def fetch(self, request):\n"
        "        await self.env.AI.run('@cf/nope/none', {'prompt': 'x'})\n"
        "        return Response('unreachable')\n",
        encoding="utf-8",
    )
    (tmp_path / "wrangler.toml").write_text('name = "bad"\nmain = "entry.py"\n[ai]\nbinding = "AI"\n')
    config = WranglerConfig.load(tmp_path / "wrangler.toml")
    async with served_worker(config, credentials, fake) as worker:
        response = await worker.get("/")
    assert response.status_code == 500
    assert (
        response.text
        == "Error: InferenceUpstreamError: 5007: AiError: AiError: No such model @cf/nope/none or task\n"
    )

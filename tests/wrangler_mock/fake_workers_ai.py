"""A small stand-in for the Kumo gateway, speaking the published Workers AI wire format.

Used where the real `kumo serve` cannot be made to do something on demand (and until it exists):
the v4 envelope, SSE frames with random `p` padding ending in `data: [DONE]`, both text-generation
families, the catalog with `page`/`per_page`, `/memberships`, and the documented error codes
(workers-ai-api.md §1, §3, §6). Its answers are computed from the request (echoes, image digests,
tool calls parsed from the prompt), so the tests can check what the Worker actually sent.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import re
import secrets
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

TOKEN = "test-token-0123456789"
ACCOUNT = "0123456789abcdef0123456789abcdef"
LEGACY_MODEL = "@cf/meta/llama-3.1-8b-instruct"
OPENAI_MODEL = "@cf/moonshotai/kimi-k2.6"
SLOW_FRAME_DELAY_S = 0.05  # a prompt containing "slow" streams this slowly…
SLOW_NUM_FRAMES = 400  # …for this many frames (20 s), long enough to be abandoned
TEXT_GENERATION = {
    "id": "c329a1f9-323d-4e91-b2aa-582dd4188d34",
    "name": "Text Generation",
    "description": "LLMs",
}


def envelope(result: Any, headers: dict[str, str] | None = None, **extra: Any) -> JSONResponse:
    return JSONResponse(
        {"result": result, "success": True, "errors": [], "messages": [], **extra}, headers=headers
    )


def failure(status: int, code: int, message: str) -> JSONResponse:
    body = {"result": None, "success": False, "errors": [{"code": code, "message": message}], "messages": []}
    return JSONResponse(body, status)


def catalog_entry(name: str, description: str) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid5(uuid.NAMESPACE_URL, name)),
        "source": 1,
        "name": name,
        "description": description,
        "task": TEXT_GENERATION,
        "created_at": "2026-04-20 01:40:35.001",
        "tags": [],
        "properties": [{"property_id": "context_window", "value": "262144"}],
    }


@dataclass
class FakeGateway:
    """The app plus what it saw: `requests` holds (path, query, headers, body) of every run call."""

    num_filler_models: int = 0
    requests: list[dict[str, Any]] = field(default_factory=list)
    num_open_streams: int = 0
    num_frames_sent: int = 0

    def __post_init__(self) -> None:
        self.catalog = [
            catalog_entry(OPENAI_MODEL, "Kimi K2.6 is a frontier-scale open-source model. " * 4),
            catalog_entry(LEGACY_MODEL, "Llama 3.1 8B instruct."),
        ] + [catalog_entry(f"@cf/test/filler-{i:03d}", f"filler {i}") for i in range(self.num_filler_models)]
        prefix = "/client/v4"
        self.app = Starlette(
            routes=[
                Route(f"{prefix}/memberships", self.memberships),
                Route(f"{prefix}/accounts/{{account}}/ai/models/search", self.search),
                Route(f"{prefix}/accounts/{{account}}/ai/run/{{model:path}}", self.run, methods=["POST"]),
            ]
        )

    async def sse(self, frames: list[dict[str, Any]], delay: float) -> AsyncIterator[bytes]:
        """The frames as SSE; counts open streams so tests can see a disconnect reach the gateway."""
        self.num_open_streams += 1
        try:
            for frame in frames:
                yield f"data: {json.dumps(frame)}\n\n".encode()
                self.num_frames_sent += 1
                if delay:
                    await asyncio.sleep(delay)
            yield b"data: [DONE]\n\n"
        finally:
            self.num_open_streams -= 1

    def _denied(self, request: Request) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {TOKEN}":
            return failure(401, 10000, "Authentication error")
        account = request.path_params.get("account")
        if account is not None and account != ACCOUNT:
            return failure(
                404,
                7003,
                f"Could not route to /accounts/{account}, perhaps your object identifier is invalid?",
            )
        return None

    async def memberships(self, request: Request) -> Response:
        return self._denied(request) or envelope([{"id": "m1", "account": {"id": ACCOUNT, "name": "Test"}}])

    async def search(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        entries = [e for e in self.catalog if request.query_params.get("search", "") in e["name"]]
        page, per_page = (
            int(request.query_params.get("page", 1)),
            int(request.query_params.get("per_page", 50)),
        )
        chunk = entries[(page - 1) * per_page : page * per_page]
        info = {"page": page, "per_page": per_page, "count": len(chunk), "total_count": len(entries)}
        return envelope(chunk, result_info=info)

    async def run(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        model = request.path_params["model"]
        try:
            body = json.loads(await request.body())
        except ValueError:
            return failure(400, 3003, "Request is missing headers or body: body")
        self.requests.append(
            {
                "model": model,
                "query": dict(request.query_params),
                "headers": dict(request.headers),
                "body": body,
            }
        )
        if model not in (LEGACY_MODEL, OPENAI_MODEL):
            return failure(400, 5007, f"AiError: AiError: No such model {model} or task")
        if (body.get("options") or {}).get("rejectIfBusy"):
            return failure(429, 3040, "Capacity temporarily exceeded, please try again.")
        if request.query_params.get("queueRequest") == "true":
            return envelope({"status": "queued", "request_id": str(uuid.uuid4()), "model": model})
        text, tool_calls = answer(body)
        usage = {
            "prompt_tokens": 7,
            "completion_tokens": len(text.split()),
            "total_tokens": 7 + len(text.split()),
        }
        headers = {"cf-ai-req-id": "req-" + secrets.token_hex(4)}
        if body.get("stream"):
            frames = (
                legacy_frames(text, usage) if model == LEGACY_MODEL else openai_frames(model, text, usage)
            )
            delay = SLOW_FRAME_DELAY_S if "slow" in str(last_user_content(body)) else 0.0
            if delay:
                frames = frames[:1] * SLOW_NUM_FRAMES
            return StreamingResponse(self.sse(frames, delay), media_type="text/event-stream", headers=headers)
        if model == LEGACY_MODEL:
            return envelope({"response": text, "usage": usage}, headers=headers)
        return envelope(chat_completion(model, text, tool_calls, usage), headers=headers)


def last_user_content(body: dict[str, Any]) -> Any:
    if "prompt" in body:
        return body["prompt"]
    return next(m["content"] for m in reversed(body["messages"]) if m["role"] == "user")


def answer(body: dict[str, Any]) -> tuple[str, list[dict[str, Any]]]:
    """Text and tool calls computed from the request."""
    messages = body.get("messages") or []
    if messages and messages[-1]["role"] == "tool":
        return f"Done: {messages[-1]['content']}.", []
    content = last_user_content(body)
    if isinstance(content, list):
        parts = []
        for part in content:
            if part["type"] == "image_url":
                head, data = part["image_url"]["url"].split(",", 1)
                raw = base64.b64decode(data)
                parts.append(
                    f"{head.removeprefix('data:')} {len(raw)} bytes sha256:{hashlib.sha256(raw).hexdigest()[:16]}"
                )
            else:
                parts.append(part["text"])
        return " | ".join(parts), []
    if body.get("tools") and (match := re.search(r"weather in ([A-Z][a-z]+)", content)):
        return "", [{"name": "get_weather", "arguments": {"city": match.group(1)}}]
    return f"echo: {content}", []


def chat_completion(
    model: str, text: str, tool_calls: list[dict[str, Any]], usage: dict[str, int]
) -> dict[str, Any]:
    calls = [
        {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": c["name"], "arguments": json.dumps(c["arguments"])},
        }
        for i, c in enumerate(tool_calls)
    ]
    message = {"role": "assistant", "content": text or None, "refusal": None, "tool_calls": calls or None}
    choice = {
        "index": 0,
        "finish_reason": "tool_calls" if calls else "stop",
        "logprobs": None,
        "message": message,
    }
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": 1786000000,
        "model": model,
        "choices": [choice],
        "usage": usage,
    }


def legacy_frames(text: str, usage: dict[str, int]) -> list[dict[str, Any]]:
    return [{"response": w, "p": secrets.token_hex(3)} for w in re.findall(r"\S+\s*", text)] + [
        {"response": "", "usage": usage}
    ]


def openai_frames(model: str, text: str, usage: dict[str, int]) -> list[dict[str, Any]]:
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1786000000, "model": model}
    frames = [
        {
            **head,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}],
        }
    ]
    frames += [
        {
            **head,
            "choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}],
            "p": secrets.token_hex(2),
        }
        for w in re.findall(r"\S+\s*", text)
    ]
    frames.append({**head, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
    return frames + [{"response": "", "usage": usage}]

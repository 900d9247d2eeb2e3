"""`/ai/run` with the legacy Workers AI family, against scripted fake backends (wire format §1.3 a)."""

from __future__ import annotations

import msgspec
from gateway_harness import LEGACY, Harness, harness  # noqa: F401  (fixture)


def sse_events(text: str) -> list[object]:
    frames = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert frames[-1] == "[DONE]"
    return [msgspec.json.decode(f) for f in frames[:-1]]


async def test_prompt_returns_response_and_usage_in_the_envelope(harness: Harness) -> None:
    r = await harness.http.post(harness.path(f"/ai/run/{LEGACY}"), headers=harness.auth(), json={"prompt": "hello"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    assert body["result"]["response"] == "echo: hello"
    usage = body["result"]["usage"]
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"] > 0
    sent = harness.backends["legacy"][0].requests[-1]
    assert sent.sampling.max_tokens == 256  # the Workers AI default
    assert sent.messages is not None and sent.messages[-1].content == "hello"

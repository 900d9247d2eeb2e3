"""Reading a Workers AI event stream: `data: <json>` events separated by blank lines, then `[DONE]`.

Both text-generation families are understood (workers-ai-api.md §1.5): legacy frames carry the
text in `response`; OpenAI-native frames carry it in `choices[0].delta.content`, followed by a
Workers AI trailer `{"response": "", "usage": …}`. The random `p` padding is ignored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator
from typing import Any

DONE = "[DONE]"


async def iter_data(chunks: AsyncIterable[bytes]) -> AsyncIterator[str]:
    """Each event's `data` payload (multi-line data joined with newlines), `[DONE]` included."""
    buffer = b""
    async for chunk in chunks:
        buffer += chunk.replace(b"\r\n", b"\n")
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            data = _data_of(event.decode("utf-8"))
            if data is not None:
                yield data
    if buffer.strip():
        data = _data_of(buffer.decode("utf-8"))
        if data is not None:
            yield data


def _data_of(event: str) -> str | None:
    lines = [line[5:].removeprefix(" ") for line in event.split("\n") if line.startswith("data:")]
    return "\n".join(lines) if lines else None


async def iter_frames(chunks: AsyncIterable[bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON frames of the stream, up to (not including) `[DONE]`."""
    async for data in iter_data(chunks):
        if data == DONE:
            return
        yield json.loads(data)


def frame_text(frame: dict[str, Any]) -> str:
    """The generated text one frame adds, whichever family sent it."""
    choices = frame.get("choices")
    if isinstance(choices, list) and choices:
        delta = choices[0].get("delta") or {}
        return delta.get("content") or ""
    response = frame.get("response")
    return response if isinstance(response, str) else ""


def result_text(result: Any) -> str | None:
    """The answer text of a non-streamed result: `response` (legacy) or the first choice's content."""
    if not isinstance(result, dict):
        return None
    if "response" in result:
        response = result["response"]
        return response if isinstance(response, str) else json.dumps(response)
    choices = result.get("choices")
    if isinstance(choices, list) and choices:
        return (choices[0].get("message") or {}).get("content") or ""
    return None

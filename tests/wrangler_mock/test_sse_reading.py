"""Reading event streams as the `ai run --stream` command does: framing per the SSE spec."""

from __future__ import annotations

from collections.abc import AsyncIterator

from wrangler_mock.sse import frame_text, iter_data, iter_frames, result_text


async def chunked(data: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(data), size):
        yield data[i : i + size]


STREAM = (
    b'data: {"response":"Hel","p":"ab"}\r\n\r\n'
    b": a comment line\n\n"
    b'data: {"response":"lo"}\n\n'
    b'data: {"response":"","usage":{"total_tokens":3}}\n\n'
    b"data: [DONE]\n\n"
)


async def test_frames_survive_any_chunking() -> None:
    for size in (1, 2, 7, len(STREAM)):
        frames = [f async for f in iter_frames(chunked(STREAM, size))]
        assert "".join(frame_text(f) for f in frames) == "Hello"
        assert frames[-1]["usage"] == {"total_tokens": 3}


async def test_multiline_data_and_missing_final_blank_line() -> None:
    data = [d async for d in iter_data(chunked(b"data: a\ndata: b\n\ndata: [DONE]", 3))]
    assert data == ["a\nb", "[DONE]"]


def test_text_of_both_families() -> None:
    chunk = {"choices": [{"index": 0, "delta": {"content": "x", "reasoning_content": None}}]}
    assert frame_text(chunk) == "x" and frame_text({"choices": [{"delta": {}}]}) == ""
    assert result_text({"response": "r"}) == "r" and result_text({"response": {"ok": True}}) == '{"ok": true}'
    completion = {"choices": [{"message": {"content": None, "reasoning_content": "hm"}}]}
    assert result_text(completion) == "" and result_text([1]) is None

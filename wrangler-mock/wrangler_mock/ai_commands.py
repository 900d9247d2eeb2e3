"""`wrangler-mock ai models` and `wrangler-mock ai run`: the catalog and one inference from a shell.

`ai models` follows wrangler's `ai models` (listCatalog.ts): the whole catalog paged 50 at a time,
`--json` printing the model objects verbatim (`JSON.stringify(entries, null, 2)`), otherwise a
table of model (the UUID), name, description (truncated to the terminal) and task name.
"""

from __future__ import annotations

import json
import shutil
import sys
from typing import Any, TextIO

from wrangler_mock.ai_binding import Ai
from wrangler_mock.api import CloudflareApi
from wrangler_mock.jsvalue import ReadableStream, to_py
from wrangler_mock.sse import frame_text, iter_frames, result_text
from wrangler_mock.table import render

DESCRIPTION_FALLBACK_WIDTH = 100  # wrangler's width when stdout is not a terminal


def truncate_description(description: str | None, already_used: int, out: TextIO) -> str:
    if not description:
        return ""
    width = shutil.get_terminal_size().columns - already_used if out.isatty() else DESCRIPTION_FALLBACK_WIDTH
    width = max(width, 0)
    return description[:width] + ("..." if len(description) > width else "")


def format_models(entries: list[dict[str, Any]], *, as_json: bool, out: TextIO) -> str:
    if as_json:
        return json.dumps(entries, indent=2, ensure_ascii=False)
    if not entries:
        return "No models found."
    rows = []
    for entry in entries:
        task = (entry.get("task") or {}).get("name") or ""
        used = len(str(entry.get("id", ""))) + len(str(entry.get("name", ""))) + len(task) + 10
        rows.append(
            [
                str(entry.get("id", "")),
                str(entry.get("name", "")),
                truncate_description(entry.get("description"), used, out),
                task,
            ]
        )
    return render(["model", "name", "description", "task"], rows)


async def models_command(api: CloudflareApi, *, as_json: bool, out: TextIO | None = None) -> int:
    out = out or sys.stdout
    entries = await api.list_models()
    print(format_models(entries, as_json=as_json, out=out), file=out, flush=True)
    return 0


def build_inputs(
    prompt: str,
    *,
    system: str | None,
    max_tokens: int | None,
    temperature: float | None,
    stream: bool,
    extra: dict[str, Any],
) -> dict[str, Any]:
    """The run body: a bare `prompt`, or `messages` when a system prompt is given."""
    inputs: dict[str, Any] = (
        {"messages": [{"role": "system", "content": system}, {"role": "user", "content": prompt}]}
        if system
        else {"prompt": prompt}
    )
    if max_tokens is not None:
        inputs["max_tokens"] = max_tokens
    if temperature is not None:
        inputs["temperature"] = temperature
    if stream:
        inputs["stream"] = True
    return {**inputs, **extra}


async def run_command(
    api: CloudflareApi,
    model: str,
    inputs: dict[str, Any],
    *,
    session: str | None,
    as_json: bool,
    out: TextIO | None = None,
) -> int:
    """Run `model` once; print the answer text (streamed as it comes with `stream`), or the JSON result."""
    out = out or sys.stdout
    options = {"extraHeaders": {"x-session-affinity": session}} if session else None
    result = await Ai(api).run(model, inputs, options)
    if isinstance(result, ReadableStream):
        async for frame in iter_frames(result):
            out.write(json.dumps(frame) + "\n" if as_json else frame_text(frame))
            out.flush()
        if not as_json:
            out.write("\n")
        return 0
    plain = to_py(result)
    text = None if as_json else result_text(plain)
    print(json.dumps(plain, indent=2, ensure_ascii=False) if text is None else text, file=out, flush=True)
    return 0

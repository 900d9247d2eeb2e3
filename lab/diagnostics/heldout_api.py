"""Issue 26's held-out everyday sets through the public API of a running `kumo serve` (what a user sees).

`kumo eval --heldout` scores through serving's prompt path in process; this sends the same items
(backend/tools/eval_heldout.py, same seed) as OpenAI chat completions over HTTP: tools offered as
function tools (so tool calls are grammar-constrained, as a user gets them), images as data URLs,
greedy, and scores the replies with the same checks (`call_matches`, `generation_correct`).

    OMP_NUM_THREADS=1 .venv/bin/kumo serve --data-dir /tmp/kumo-api &      # wait for the credentials block
    PYTHONPATH=. .venv/bin/python lab/diagnostics/heldout_api.py --data-dir /tmp/kumo-api \
        --family glm --items 60 --out lab/results/2026-12-04-heldout-api/after-glm.json

`kumo serve` serves the catalog's models as INT4 routed experts with an FP8 KV cache; `--model NAME`
asks a `kumo serve --model NAME=PATH` entry instead (the checkpoint as it is, float32 on the CPU).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import msgspec

from backend.tools.eval_heldout import write_sets
from backend.tools.eval_tasks import MARKUP, GenItem, ToolItem, call_matches, generation_correct, load_items
from gateway.dev_credentials import FILE_NAME, DevCredentials
from schemas.backend import ToolCallDelta

MODELS = {"glm": "@cf/zai-org/glm-5.2", "kimi": "@cf/moonshotai/kimi-k2.6"}


def openai_messages(item: GenItem | ToolItem) -> list[dict[str, Any]]:
    if item.messages is None:
        return [{"role": "user", "content": item.prompt or ""}]
    out = []
    for m in msgspec.to_builtins(item.messages):
        content = m["content"]
        if isinstance(content, list):  # image parts (base64 bytes) as OpenAI data URLs
            content = [
                {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{p['data']}"}}
                if p.get("type") == "image"
                else {"type": "text", "text": p["text"]}
                for p in content
            ]
        out.append({"role": m["role"], "content": content})
    return out


def ask(client: httpx.Client, url: str, model: str, item: GenItem | ToolItem) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": openai_messages(item),
        "temperature": 0,
        "max_tokens": 128,
    }
    if isinstance(item, ToolItem):
        body["tools"] = [
            {
                "type": "function",
                "function": {k: v for k, v in msgspec.to_builtins(t).items() if v is not None},
            }
            for t in item.tools
        ]
    r = client.post(url, json=body, timeout=600)
    reply: dict[str, Any] = {"status": r.status_code}
    if r.status_code != 200:
        reply["error"] = r.text[:300]
        return reply
    choice = r.json()["choices"][0]
    message = choice["message"]
    calls = [
        ToolCallDelta(
            index=i, id=c.get("id"), name=c["function"]["name"], arguments=c["function"]["arguments"]
        )
        for i, c in enumerate(message.get("tool_calls") or [])
    ]
    reply.update(content=message.get("content") or "", reasoning=message.get("reasoning_content"),
                 calls=[(c.name, c.arguments) for c in calls], finish_reason=choice.get("finish_reason"))  # fmt: skip
    if isinstance(item, ToolItem):
        reply["correct"] = call_matches(calls, item.expected)
    else:
        reply["correct"] = generation_correct(reply["content"], item)
    return reply


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data-dir", type=Path, required=True, help="the running kumo serve's data dir")
    ap.add_argument("--url", default="http://127.0.0.1:8787")
    ap.add_argument("--family", choices=sorted(MODELS), required=True, help="which held-out sets")
    ap.add_argument("--model", help="the model name asked (default: the family's catalog name)")
    ap.add_argument("--items", type=int, default=60)
    ap.add_argument("--concurrency", type=int, default=2, help="requests in flight")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args(argv)
    model = a.model or MODELS[a.family]
    creds = msgspec.json.decode((a.data_dir / FILE_NAME).read_bytes(), type=DevCredentials)
    url = f"{a.url}/client/v4/accounts/{creds.account_id}/ai/v1/chat/completions"
    report: dict[str, Any] = {
        "command": " ".join(["lab/diagnostics/heldout_api.py", *argv]),
        "model": model,
        "sets": {},
    }
    headers = {"Authorization": f"Bearer {creds.api_token}"}
    with httpx.Client(headers=headers, trust_env=False) as client:
        for path in write_sets(Path(tempfile.mkdtemp()), a.family, a.items):
            _, items = load_items(path)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(a.concurrency) as pool:
                replies = list(pool.map(lambda it: ask(client, url, model, it), items))
            seconds = time.perf_counter() - t0
            right = sum(bool(r.get("correct")) for r in replies)
            errors = sum(r["status"] != 200 for r in replies)
            markup = sum(bool(MARKUP.search(r.get("content") or "")) for r in replies)
            print(f"{path.stem}: {right}/{len(items)} right, {errors} errors, {seconds:.0f} s", flush=True)
            report["sets"][path.stem] = {
                "accuracy": right / len(items), "items": len(items), "http_errors": errors, "seconds": round(seconds, 1),
                "replies_with_markup": markup,
                "samples": [
                    {"ask": openai_messages(it)[-1]["content"] if isinstance(openai_messages(it)[-1]["content"], str)
                     else "[image] " + openai_messages(it)[-1]["content"][-1]["text"],
                     "expected": msgspec.to_builtins(it.expected) if isinstance(it, ToolItem) else None,
                     "answer": None if isinstance(it, ToolItem) else it.answer, **r}
                    for it, r in zip(items, replies, strict=True)
                ],
            }  # fmt: skip
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

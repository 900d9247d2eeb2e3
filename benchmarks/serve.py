"""`kumo bench serve`: a serving benchmark through the gateway's public Workers AI route.

N concurrent clients stream chat completions from `/client/v4/accounts/ID/ai/run/MODEL` (SSE), each
sending its next request as soon as the last one ends, for `--requests` requests in all or for
`--duration` seconds (requests in flight at the end finish and count). Prompts are seeded random
words, a different prompt per request (the prefix cache finds only the chat template's first page);
their length in words is calibrated against the `usage.prompt_tokens` the final SSE event reports,
so a prompt is `--input-len` tokens give or take the tokenizer's spread (each request's realised
count is recorded). `max_tokens` is `--output-len`; the public API has no `ignore_eos`, so a model
may stop earlier: the realised output tokens (`usage.completion_tokens`) are what the figures use.

Per request: TTFT (send → first chunk with text), e2e (send → `[DONE]`), inter-token latency (the
gaps between text chunks; a chunk may carry several tokens), TPOT = (e2e − TTFT) / (tokens − 1).
Summary: p50/p99 of each, requests/s and output tok/s over the wall time (first send → last end),
and goodput = requests/s that met both SLOs (`--slo-ttft-ms`, `--slo-tpot-ms`; a one-token answer
has no TPOT and meets that SLO). Failed requests are counted and excluded from the figures.

    kumo bench serve --url URL --account ID --token TOKEN --model @cf/moonshotai/kimi-k2.6 \\
        --concurrency 4 --input-len 256 --output-len 64 [--slo-ttft-ms 2000 --slo-tpot-ms 200] \\
        [--requests 32 | --duration 60] [--out FILE] [--machine "what the server ran on"]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import random
import shlex
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from benchmarks.client import DONE, machine, percentile, sse_data

WORDS = (  # noqa: SIM905 (a word list reads better as text)
    "time year people way day man thing woman life child world school state family student group country "
    "problem hand part place case week company system program question work government number night point "
    "home water room mother area money story fact month lot right study book eye job word business issue "
    "side kind head house service friend father power hour game line end member law car city community name "
    "president team minute idea kid body information back parent face others level office door health person "
    "art war history party result change morning reason research girl guy moment air teacher force education "
    "river mountain garden window table music paper market light field island bridge forest letter village"
).split()
CALIBRATION_PROMPTS = 6  # prompts of one length averaged per correction (their counts spread)


@dataclass(slots=True)
class RequestResult:
    index: int
    client: int
    start_s: float  # since the benchmark's start
    prompt_words: int
    prompt_tokens: int | None = None  # usage.prompt_tokens
    output_tokens: int | None = None  # usage.completion_tokens
    num_chunks: int = 0  # SSE chunks carrying text
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    tpot_ms: float | None = None  # None: fewer than two tokens
    itl_ms: list[float] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def is_ok(self) -> bool:
        """Answered to the end. An answer with no text (its tokens all markup or an end token: seen
        from the nano Kimi on the H200, 1 of 368) is an answer, not an error; it has no TTFT."""
        return self.error is None and self.e2e_ms is not None and self.output_tokens is not None


def prompt_of(num_words: int, seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def text_of(event: dict[str, Any]) -> str:
    """The text a streamed event carries: OpenAI chunk content, reasoning or a tool call's name and
    arguments, or a legacy `response`. (A call cut by `max_tokens` streams nothing at all: its
    request has no first token.)"""
    choices = event.get("choices")
    if choices:
        delta = choices[0].get("delta") or {}
        calls = "".join(
            str((c.get("function") or {}).get("name") or "")
            + str((c.get("function") or {}).get("arguments") or "")
            for c in delta.get("tool_calls") or []
        )
        return str(delta.get("content") or "") + str(delta.get("reasoning_content") or "") + calls
    return str(event.get("response") or "") if "usage" not in event else ""


async def one_request(
    http: httpx.AsyncClient, url: str, body: dict[str, Any], result: RequestResult, t0: float
) -> RequestResult:
    """Send one streaming request and time it into `result` (errors are recorded, never raised)."""
    sent = time.perf_counter()
    result.start_s = sent - t0
    last: float | None = None
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                result.error = f"http {r.status_code}: {(await r.aread())[:200]!r}"
                return result
            async for data in sse_data(r):
                now = time.perf_counter()
                if data == DONE:
                    result.e2e_ms = (now - sent) * 1e3
                    break
                event = json.loads(data)
                if "error" in event or "errors" in event:
                    result.error = f"in-stream error: {data[:200]}"
                    return result
                if text_of(event):
                    result.num_chunks += 1
                    if last is None:
                        result.ttft_ms = (now - sent) * 1e3
                    else:
                        result.itl_ms.append((now - last) * 1e3)
                    last = now
                if event.get("choices") and event["choices"][0].get("finish_reason"):
                    result.finish_reason = event["choices"][0]["finish_reason"]
                if "usage" in event and "choices" not in event:
                    result.prompt_tokens = event["usage"]["prompt_tokens"]
                    result.output_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        result.error = f"transport: {type(exc).__name__}: {exc}"
        return result
    if result.e2e_ms is None:
        result.error = "stream ended without [DONE]"
    elif result.ttft_ms is not None and result.output_tokens and result.output_tokens > 1:
        result.tpot_ms = (result.e2e_ms - result.ttft_ms) / (result.output_tokens - 1)
    return result


def body_of(prompt: str, max_tokens: int, extra: dict[str, Any]) -> dict[str, Any]:
    return {
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    } | extra


async def calibrate(
    http: httpx.AsyncClient, url: str, input_len: int, extra: dict[str, Any], seed: int
) -> dict[str, Any]:
    """Words per prompt for `input_len` prompt tokens on average: two probes fit tokens = template +
    rate · words, then twice the mean of `CALIBRATION_PROMPTS` prompts of the estimated length
    re-estimates the rate (1-token answers, different prompts each; they warm the path too)."""
    probes: list[tuple[int, int]] = []

    async def tokens(words: int) -> int:
        body = body_of(prompt_of(words, seed - 1 - len(probes)), 1, extra)
        r = await one_request(http, url, body, RequestResult(-1, -1, 0.0, words), 0.0)
        if r.error or r.prompt_tokens is None:
            raise RuntimeError(f"calibration request failed: {r.error or 'no usage in the stream'}")
        probes.append((words, r.prompt_tokens))
        return r.prompt_tokens

    w1, w2 = max(1, input_len // 4), max(2, input_len // 2)
    p1, p2 = await tokens(w1), await tokens(w2)
    rate = max((p2 - p1) / (w2 - w1), 0.1)  # tokens per word
    template = p1 - rate * w1
    words = max(1, round((input_len - template) / rate))
    for _ in range(2):  # the mean of several prompts: a single prompt's count spreads by several %
        got = statistics.fmean([await tokens(words) for _ in range(CALIBRATION_PROMPTS)])
        rate = max((got - template) / words, 0.1)  # this length's tokens per word
        words = max(1, round((input_len - template) / rate))
    return {
        "words": words,
        "tokens_per_word": rate,
        "template_tokens": template,
        "probes": [{"words": w, "prompt_tokens": p} for w, p in probes],
    }


async def drive(args: argparse.Namespace) -> tuple[list[tuple[list[RequestResult], float]], dict[str, Any]]:
    """Calibrate, warm up, then `args.repeats` measured windows back to back: (results, wall) each."""
    url = f"{args.url.rstrip('/')}/client/v4/accounts/{args.account}/ai/run/{args.model}"
    extra = json.loads(args.extra) if args.extra else {}
    limits = httpx.Limits(
        max_connections=args.concurrency + 2, max_keepalive_connections=args.concurrency + 2
    )
    headers = {"authorization": f"Bearer {args.token}"}
    async with httpx.AsyncClient(
        timeout=args.timeout_s, limits=limits, headers=headers, trust_env=False
    ) as http:
        calibration = await calibrate(http, url, args.input_len, extra, args.seed)
        words = calibration["words"]
        for i in range(args.warmup):  # full-length requests, not counted
            await one_request(
                http, url, body_of(prompt_of(words, args.seed + 10**6 + i), args.output_len, extra),
                RequestResult(-1, -1, 0.0, words), 0.0,
            )  # fmt: skip
        windows = [  # each repeat its own prompts: seeds 10**5 apart
            await window(http, url, args, words, extra, args.seed + 10**5 * k) for k in range(args.repeats)
        ]
    return windows, calibration


async def window(
    http: httpx.AsyncClient, url: str, args: argparse.Namespace, words: int, extra: dict[str, Any], seed: int
) -> tuple[list[RequestResult], float]:
    """One measured window: `args.concurrency` clients, each sending its next request when the last
    ends, for `args.requests` requests or `args.duration` seconds; the results and the wall time."""
    results: list[RequestResult] = []
    next_index = 0
    t0 = time.perf_counter()
    deadline = t0 + args.duration if args.duration else None

    async def client(c: int) -> None:
        nonlocal next_index
        while (deadline is None and next_index < args.requests) or (
            deadline is not None and time.perf_counter() < deadline
        ):
            i, next_index = next_index, next_index + 1
            body = body_of(prompt_of(words, seed + i), args.output_len, extra)
            results.append(await one_request(http, url, body, RequestResult(i, c, 0.0, words), t0))

    await asyncio.gather(*(client(c) for c in range(args.concurrency)))
    return sorted(results, key=lambda r: r.index), time.perf_counter() - t0


def meets_slo(r: RequestResult, slo_ttft_ms: float | None, slo_tpot_ms: float | None) -> bool:
    """Both SLOs that are set hold for a successful request (no TPOT: a one-token answer meets it)."""
    if not r.is_ok:
        return False
    first_ms = r.ttft_ms if r.ttft_ms is not None else r.e2e_ms  # no text: all of it came at the end
    ttft_ok = slo_ttft_ms is None or (first_ms is not None and first_ms <= slo_ttft_ms)
    tpot_ok = slo_tpot_ms is None or r.tpot_ms is None or r.tpot_ms <= slo_tpot_ms
    return ttft_ok and tpot_ok


def _dist(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": percentile(values, 0.5), "p99": percentile(values, 0.99), "mean": statistics.fmean(values)}


def summarize(
    results: list[RequestResult], wall_s: float, slo_ttft_ms: float | None, slo_tpot_ms: float | None
) -> dict[str, Any]:
    ok = [r for r in results if r.is_ok]
    num_good = sum(meets_slo(r, slo_ttft_ms, slo_tpot_ms) for r in results)
    output_tokens = sum(r.output_tokens or 0 for r in ok)
    has_slo = slo_ttft_ms is not None or slo_tpot_ms is not None
    return {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(results) - len(ok),
        "wall_s": wall_s,
        "requests_per_s": len(ok) / wall_s,
        "output_tok_s": output_tokens / wall_s,
        "goodput_requests_per_s": num_good / wall_s if has_slo else None,
        "num_meeting_slo": num_good if has_slo else None,
        "prompt_tokens": _dist([float(r.prompt_tokens) for r in ok if r.prompt_tokens is not None]),
        "output_tokens": _dist([float(r.output_tokens or 0) for r in ok]) | {"total": output_tokens},
        "ttft_ms": _dist([r.ttft_ms for r in ok if r.ttft_ms is not None]),
        "tpot_ms": _dist([r.tpot_ms for r in ok if r.tpot_ms is not None]),
        "itl_ms": _dist([x for r in ok for x in r.itl_ms]),
        "e2e_ms": _dist([r.e2e_ms for r in ok if r.e2e_ms is not None]),
        "finish_reasons": {f: sum(r.finish_reason == f for r in ok) for f in {r.finish_reason for r in ok}},
    }


REPEATED = {  # the figures each repeat gives one sample of: record key -> path in a summary
    "output_tok_s": ("output_tok_s",),
    "requests_per_s": ("requests_per_s",),
    "goodput_requests_per_s": ("goodput_requests_per_s",),
    "ttft_ms_p50": ("ttft_ms", "p50"),
    "ttft_ms_p99": ("ttft_ms", "p99"),
    "tpot_ms_p50": ("tpot_ms", "p50"),
    "tpot_ms_p99": ("tpot_ms", "p99"),
}


def per_repeat(repeats: list[dict[str, Any]]) -> dict[str, dict[str, Any] | None]:
    """Each repeated figure as `{"value": median, "samples": [one per repeat], "spread": [min, max]}`
    (None where a repeat has no value: no SLO set, no request with a TPOT)."""
    out: dict[str, dict[str, Any] | None] = {}
    for key, path in REPEATED.items():
        samples = []
        for s in repeats:
            x: Any = s
            for part in path:
                x = x[part]
            samples.append(x)
        out[key] = (
            None
            if any(x is None for x in samples)
            else {
                "value": statistics.median(samples),
                "samples": samples,
                "spread": [min(samples), max(samples)],
            }
        )
    return out


def markdown_line(config: dict[str, Any], s: dict[str, Any]) -> str:
    def f(x: float | None, fmt: str = "{:.1f}") -> str:
        return "-" if x is None else fmt.format(x)

    return (
        f"| {config['model']} | {config['concurrency']} | {f(s['prompt_tokens']['mean'], '{:.0f}')} "
        f"| {config['output_len']} ({f(s['output_tokens']['mean'])} realised) | {s['num_ok']}/{s['num_requests']} "
        f"| {f(s['requests_per_s'], '{:.2f}')} | {f(s['output_tok_s'])} "
        f"| {f(s['ttft_ms']['p50'], '{:.0f}')} / {f(s['ttft_ms']['p99'], '{:.0f}')} "
        f"| {f(s['tpot_ms']['p50'])} / {f(s['tpot_ms']['p99'])} | {f(s['itl_ms']['p50'])} / {f(s['itl_ms']['p99'])} "
        f"| {f(s['goodput_requests_per_s'], '{:.2f}')} |"
    )


MARKDOWN_HEADER = (
    "| model | conc. | prompt tok | max_tokens (mean out) | ok | req/s | out tok/s | TTFT p50/p99 ms "
    "| TPOT p50/p99 ms | ITL p50/p99 ms | goodput req/s |\n|---|---|---|---|---|---|---|---|---|---|---|"
)


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="kumo bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="the gateway, e.g. http://127.0.0.1:8787")
    ap.add_argument("--account", required=True)
    ap.add_argument("--token", required=True)
    ap.add_argument("--model", required=True, help="e.g. @cf/moonshotai/kimi-k2.6")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=256, help="prompt tokens (calibrated, see --help)")
    ap.add_argument("--output-len", type=int, default=64, help="max_tokens")
    ap.add_argument("--slo-ttft-ms", type=float, default=None)
    ap.add_argument("--slo-tpot-ms", type=float, default=None)
    stop = ap.add_mutually_exclusive_group()
    stop.add_argument("--requests", type=int, default=None, help="requests in all (default 8 x concurrency)")
    stop.add_argument("--duration", type=float, default=None, help="seconds of sending")
    ap.add_argument("--warmup", type=int, default=1, help="full-length requests before the clock starts")
    ap.add_argument(
        "--repeats", type=int, default=1,
        help="measured windows back to back (each --requests or --duration); per_repeat: median, spread",
    )  # fmt: skip
    ap.add_argument("--extra", default="", help="JSON merged into every request body")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--machine", default="", help="recorded with the result: what the server ran on")
    ap.add_argument("--out", type=Path, default=None, help="the JSON result")
    return ap


def main(argv: list[str] | None = None) -> int:
    args_list = sys.argv[1:] if argv is None else argv
    args = parser().parse_args(args_list)
    if args.requests is None and args.duration is None:
        args.requests = 8 * args.concurrency
    windows, calibration = asyncio.run(drive(args))
    config = {k: v for k, v in vars(args).items() if k not in ("token", "out", "machine")} | {
        "calibration": calibration,
        "prompt_words": calibration["words"],
    }
    results = [r for window, _ in windows for r in window]
    summary = summarize(results, sum(wall for _, wall in windows), args.slo_ttft_ms, args.slo_tpot_ms)
    repeats = [summarize(window, wall, args.slo_ttft_ms, args.slo_tpot_ms) for window, wall in windows]
    line = markdown_line(config, summary)
    shown = [
        a if prev != "--token" else "TOKEN" for prev, a in zip(["", *args_list[:-1]], args_list, strict=True)
    ]
    record = {
        "command": shlex.join(["kumo", "bench", "serve", *shown]),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(args.machine),
        "config": config,
        "summary": summary,
        "repeats": repeats,
        "per_repeat": per_repeat(repeats),
        "markdown": line,
        "requests": [asdict(r) | {"repeat": k} for k, (window, _) in enumerate(windows) for r in window],
    }
    text = json.dumps(record, indent=1)
    if args.out is not None:
        args.out.write_text(text + "\n")
    print(MARKDOWN_HEADER + "\n" + line)
    return 0 if summary["num_errors"] == 0 else 1

"""`kumo bench attack`: the hostile-load suite (issue 27) against a running gateway, for operators.

Each attack is bounded in count and time. It prints what it tried, what it got, whether the
defence held, and the latency of a victim request of another tenant (a one-line prompt, `max_tokens`
8) made while the attack runs, next to the same request's latency unloaded. Run it only against a
gateway you operate: it opens many connections and sends oversized and hostile requests.

    kumo bench attack --url URL --account A --token T --victim-account V --victim-token VT [--quick]

Exit status 0 when every attack chosen held, 1 otherwise. `--out` writes the results as JSON;
`--pid gateway=PID --pid kimi=PID` records each local process's peak RSS during each attack.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import json
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import httpx

VICTIM_PROMPT = "Say hello in one word."


@dataclass(frozen=True)
class Target:
    url: str
    account: str  # the attacker's
    token: str
    victim_account: str
    victim_token: str
    model: str
    vision_model: str
    quick: bool  # the bounded subset CI runs: fewer connections and requests, shorter waits

    def path(self, rest: str, account: str | None = None) -> str:
        return f"{self.url}/client/v4/accounts/{account or self.account}{rest}"

    def auth(self, token: str | None = None) -> dict[str, str]:
        return {"authorization": f"Bearer {token or self.token}"}


@dataclass
class Outcome:
    name: str
    tried: str
    got: str
    held: bool
    seconds: float
    victim_s: float | None = None  # the victim's latency during the attack (None: it failed)
    peak_rss_mb: dict[str, float] | None = None  # of each watched process (`--pid`), during the attack


Attack = Callable[[Target, httpx.AsyncClient], Awaitable[tuple[str, str, bool]]]


async def victim_latency(t: Target, http: httpx.AsyncClient) -> float | None:
    """One victim request (another tenant): seconds to a 200, or None."""
    start = time.monotonic()
    try:
        r = await http.post(
            t.path(f"/ai/run/{t.model}", t.victim_account),
            headers=t.auth(t.victim_token),
            json={"prompt": VICTIM_PROMPT, "max_tokens": 8},
            timeout=120,
        )
    except httpx.HTTPError:
        return None
    return time.monotonic() - start if r.status_code == 200 else None


UNLOADED_RUNS = 5


async def unloaded_latency(t: Target, http: httpx.AsyncClient) -> float | None:
    """The victim's latency with nothing else running: the median of a few requests after a warm-up
    one (the first request after a start is slower, which would flatter every ratio); None if any fails."""
    await victim_latency(t, http)
    runs = [await victim_latency(t, http) for _ in range(UNLOADED_RUNS)]
    done = [r for r in runs if r is not None]
    return statistics.median(done) if len(done) == len(runs) else None


# ---- the attacks: each returns (what it tried, what it got, whether the defence held) ----------------
async def cross_tenant(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    r = await http.post(
        t.path(f"/ai/run/{t.model}", t.victim_account),
        headers=t.auth(),
        json={"prompt": "x", "max_tokens": 1},
    )
    return (
        "the attacker's token on the victim's account path",
        f"HTTP {r.status_code}",
        r.status_code in (401, 403),
    )


async def body_size(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    size = (11 if t.quick else 50) * 1024 * 1024
    body = b'{"prompt": "' + b"a" * size + b'"}'
    start = time.monotonic()
    try:
        r = await http.post(t.path(f"/ai/run/{t.model}"), headers=t.auth(), content=body, timeout=30)
        got, held = f"HTTP {r.status_code}", r.status_code == 413
    except httpx.HTTPError as exc:  # the server may close before reading it all
        got, held = f"closed ({type(exc).__name__})", True
    return f"a {size >> 20} MB body", f"{got} in {time.monotonic() - start:.2f} s", held


async def nesting(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    depth = 100_000
    r = await http.post(
        t.path(f"/ai/run/{t.model}"), headers={**t.auth(), "content-type": "application/json"},
        content=b"[" * depth + b"]" * depth,
    )  # fmt: skip
    return f"JSON nested {depth} levels", f"HTTP {r.status_code}", r.status_code == 400


async def metrics(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    got = []
    for what, headers in (("no token", {}), ("a tenant's token", t.auth())):
        r = await http.get(f"{t.url}/metrics", headers=headers)
        got.append(f"{what}: {r.status_code}")
        if r.status_code == 200:
            return "GET /metrics without the admin token", ", ".join(got), False
    return "GET /metrics without the admin token", ", ".join(got), True


async def big_header(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    size = 1024 * 1024
    head = f"GET /healthz HTTP/1.1\r\nHost: {_host(t)}\r\nX-Big: ".encode()
    status = await _raw(t, head + b"a" * size + b"\r\n\r\n", timeout_s=10)
    return f"a {size >> 20} MB header value", status, not status.startswith("HTTP/1.1 200")


async def slowloris(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    num, limit_s = (20, 15.0) if t.quick else (200, 60.0)
    host, port = _address(t)
    conns: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    closed_at: dict[int, float] = {}
    try:  # whatever fails, every connection opened is dropped (none outlives the attack)
        for _ in range(num):
            conns.append(await asyncio.open_connection(host, port))
        start = time.monotonic()
        for _, w in conns:
            w.write(f"GET /healthz HTTP/1.1\r\nHost: {_host(t)}\r\n".encode())
        while time.monotonic() - start < limit_s and len(closed_at) < num:
            for i, (r, w) in enumerate(conns):
                if i in closed_at:
                    continue
                try:
                    w.write(b"X-Trickle: 1\r\n")
                    await w.drain()
                except (ConnectionError, OSError):
                    closed_at[i] = time.monotonic() - start
                if r.at_eof():
                    closed_at[i] = time.monotonic() - start
            await asyncio.sleep(1.0)
    finally:
        await asyncio.gather(*(_drop(w) for _, w in conns))
    got = f"{len(closed_at)} of {num} closed by the server within {limit_s:.0f} s"
    return f"{num} connections trickling header lines", got, len(closed_at) == num


async def image_bomb(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (4096, 4096), "green").save(out, format="PNG")
    uri = "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()
    parts = [{"type": "image_url", "image_url": {"url": uri}} for _ in range(8)]
    body = {"messages": [{"role": "user", "content": [*parts, {"type": "text", "text": "?"}]}], "n": 8,
            "max_tokens": 1}  # fmt: skip
    start = time.monotonic()
    r = await http.post(t.path(f"/ai/run/{t.vision_model}"), headers=t.auth(), json=body, timeout=120)
    took = time.monotonic() - start
    tried = f"8 PNGs of 4096x4096 ({len(out.getvalue()) >> 10} KB each), n=8"
    return tried, f"HTTP {r.status_code} in {took:.2f} s", r.status_code in (400, 413, 429) and took < 10


async def ssrf(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    got, held = [], True
    for url in (
        "http://127.0.0.1:9/x.png",
        "http://[::ffff:127.0.0.1]/x.png",
        "http://169.254.169.254/x.png",
    ):
        parts = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]
        r = await http.post(
            t.path(f"/ai/run/{t.vision_model}"), headers=t.auth(),
            json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
        )  # fmt: skip
        got.append(str(r.status_code))
        held = held and r.status_code == 400
    return "image URLs at loopback, mapped loopback and the metadata address", ", ".join(got), held


async def poll_flood(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    num = 30 if t.quick else 300
    r = await http.post(
        t.path(f"/ai/run/{t.model}?queueRequest=true"), headers=t.auth(), json={"requests": [{"prompt": "p"}]}
    )
    job = {"request_id": r.json()["result"]["request_id"]}
    codes = await asyncio.gather(
        *(http.post(t.path(f"/ai/run/{t.model}"), headers=t.auth(), json=job) for _ in range(num))
    )
    counts: dict[int, int] = {}
    for c in codes:
        counts[c.status_code] = counts.get(c.status_code, 0) + 1
    return f"{num} concurrent polls of one batch job", str(counts), set(counts) <= {200, 429}


async def batch_flood(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    num, limit_s = (20, 30.0) if t.quick else (200, 120.0)
    item = {"prompt": "Write one sentence.", "max_tokens": 8}
    flood = await http.post(
        t.path(f"/ai/run/{t.model}?queueRequest=true"), headers=t.auth(), json={"requests": [item] * num}
    )
    flood_job = {"request_id": flood.json()["result"]["request_id"]}
    r = await http.post(
        t.path(f"/ai/run/{t.model}?queueRequest=true", t.victim_account),
        headers=t.auth(t.victim_token),
        json={"requests": [item]},
    )
    job = {"request_id": r.json()["result"]["request_id"]}
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        p = await http.post(
            t.path(f"/ai/run/{t.model}", t.victim_account), headers=t.auth(t.victim_token), json=job
        )
        if p.status_code == 200 and "responses" in p.json()["result"]:
            took = time.monotonic() - start
            # the attacker's job drains before the next attack, whose victim would otherwise wait on it
            drained = await _job_done(t, http, flood_job, limit_s)
            return (
                f"a {num}-request batch job, then the victim's 1-request job",
                f"victim done in {took:.1f} s; the flood drained in {_fmt(drained)}",
                True,
            )
        await asyncio.sleep(0.2)
    return (
        f"a {num}-request batch job, then the victim's 1-request job",
        f"victim not done in {limit_s:.0f} s",
        False,
    )


async def _job_done(t: Target, http: httpx.AsyncClient, job: dict[str, str], limit_s: float) -> float | None:
    """Seconds until the attacker's batch `job` has its responses, or None past `limit_s`."""
    start = time.monotonic()
    while time.monotonic() - start < limit_s:
        p = await http.post(t.path(f"/ai/run/{t.model}"), headers=t.auth(), json=job)
        if p.status_code == 200 and "responses" in p.json()["result"]:
            return time.monotonic() - start
        await asyncio.sleep(0.5)
    return None


async def grammar_bomb(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    got, held = [], True
    for depth in (10, 400):  # within the schema depth limit (compiled), and far past it (refused)
        # alternatives nested in alternatives, written as text: linear in size, any depth
        opening = '{"anyOf": [{"type": "array", "items": '
        closing = '}, {"type": "object", "minProperties": 2}]}'
        schema = opening * depth + '{"type": "string"}' + closing * depth
        head = json.dumps(
            {"model": t.model, "messages": [{"role": "user", "content": "json"}], "max_tokens": 4}
        )
        body = (
            head[:-1] + ', "response_format": {"type": "json_schema", "json_schema": {"name": "b", "schema": '
        )
        body += schema + "}}}"
        start = time.monotonic()
        r = await http.post(
            t.path("/ai/v1/chat/completions"),
            headers={**t.auth(), "content-type": "application/json"},
            content=body.encode(),
        )
        took = time.monotonic() - start
        got.append(f"depth {depth}: HTTP {r.status_code} in {took:.2f} s")
        leaked = r.status_code == 400 and "<[" in r.text  # a grammar with token ids echoed back
        held = held and r.status_code in (200, 400) and took < 10 and not leaked
    return "JSON schemas of nested anyOf alternatives", "; ".join(got), held


async def vanishing_streams(t: Target, http: httpx.AsyncClient) -> tuple[str, str, bool]:
    num = 20 if t.quick else 200
    body = {"prompt": "Count to one hundred.", "max_tokens": 256, "stream": True}

    async def vanish() -> int:
        async with http.stream("POST", t.path(f"/ai/run/{t.model}"), headers=t.auth(), json=body) as r:
            async for _ in r.aiter_bytes():
                break  # the first bytes, then gone
            return r.status_code

    codes = await asyncio.gather(*(vanish() for _ in range(num)))
    after = await victim_latency(t, http)
    got = f"{codes.count(200)} streams opened and dropped; a request after them: {_fmt(after)}"
    return f"{num} streams closed after their first bytes", got, after is not None


ATTACKS: dict[str, Attack] = {
    "cross_tenant": cross_tenant,
    "body_size": body_size,
    "nesting": nesting,
    "metrics": metrics,
    "big_header": big_header,
    "slowloris": slowloris,
    "image_bomb": image_bomb,
    "ssrf": ssrf,
    "poll_flood": poll_flood,
    "batch_flood": batch_flood,
    "grammar_bomb": grammar_bomb,
    "vanishing_streams": vanishing_streams,
}


def _address(t: Target) -> tuple[str, int]:
    parts = urlsplit(t.url)
    return parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)


def _host(t: Target) -> str:
    return urlsplit(t.url).netloc


async def _raw(t: Target, data: bytes, *, timeout_s: float) -> str:
    """Send `data` on a fresh connection; the status line answered, or how the connection ended."""
    host, port = _address(t)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        async with asyncio.timeout(timeout_s):
            try:
                writer.write(data)
                await writer.drain()
            except (ConnectionError, OSError):
                pass  # answered and closed before we finished: read what it said
            line = await reader.readline()
        return line.decode(errors="replace").strip() or "closed without an answer"
    except TimeoutError:
        return f"no answer within {timeout_s:.0f} s"
    except (ConnectionError, OSError) as exc:
        return f"closed ({type(exc).__name__})"
    finally:
        await _drop(writer)


async def _drop(writer: asyncio.StreamWriter) -> None:
    """Close a raw connection now and wait until its socket is closed: `close()` alone keeps a
    transport (and its socket) open until its unsent bytes are written, which a server that stopped
    reading never lets happen; such a socket would outlive the attack."""
    writer.transport.abort()
    with contextlib.suppress(ConnectionError, OSError):
        await writer.wait_closed()


def rss_mb(pid: int) -> float:
    """A process's resident memory (Linux `/proc`), MB; NaN when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as f:
            line = next(ln for ln in f if ln.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return float("nan")
    return int(line.split()[1]) / 1024


async def _peaks(pids: dict[str, int], peaks: dict[str, float]) -> None:
    """Sample the watched processes' RSS every 100 ms into `peaks` until cancelled."""
    while True:
        for name, pid in pids.items():
            peaks[name] = max(peaks.get(name, 0.0), rss_mb(pid))
        await asyncio.sleep(0.1)


async def run(
    t: Target, names: list[str], pids: dict[str, int] | None = None
) -> tuple[float | None, list[Outcome]]:
    """The victim's unloaded latency, then each attack with a victim request made while it runs
    (and the peak RSS of the processes in `pids`, if any, on this machine)."""
    outcomes = []
    async with httpx.AsyncClient(timeout=60, limits=httpx.Limits(max_connections=400)) as http:
        unloaded = await unloaded_latency(t, http)
        print(f"victim unloaded (median of {UNLOADED_RUNS}, after a warm-up): {_fmt(unloaded)}", flush=True)
        for name in names:
            start = time.monotonic()
            peaks: dict[str, float] = {}
            sampler = asyncio.create_task(_peaks(pids or {}, peaks))
            attack = asyncio.create_task(ATTACKS[name](t, http))
            await asyncio.sleep(0.2)
            victim = await victim_latency(t, http)
            try:
                tried, got, held = await attack
            except Exception as exc:  # an attack that could not be mounted counts as not held
                tried, got, held = name, f"failed to run: {exc!r}", False
            sampler.cancel()
            outcome = Outcome(name, tried, got, held, time.monotonic() - start, victim, peaks or None)
            outcomes.append(outcome)
            ratio = f" ({victim / unloaded:.1f}x unloaded)" if victim and unloaded else ""
            memory = "".join(f"; {n} peak RSS {mb:.0f} MB" for n, mb in peaks.items())
            print(
                f"{'held ' if held else 'BROKE'} {name}: tried {tried}; got {got}; "
                f"victim {_fmt(victim)}{ratio}{memory}",
                flush=True,
            )
    return unloaded, outcomes


# issue 27's goal: the victim within 2x its unloaded latency, the gateway under 512 MB, each backend under 4 GB
GOAL = {"victim_ratio_max": 2.0, "gateway_rss_mb_max": 512, "backend_rss_mb_max": 4096}


def goal_met(o: Outcome, unloaded: float | None) -> bool:
    """Whether one attack met the goal: held, the victim served within the ratio, every watched
    process (`gateway`, the rest backends) under its bound."""
    if not o.held or o.victim_s is None or unloaded is None:
        return False
    if o.victim_s > GOAL["victim_ratio_max"] * unloaded:
        return False
    for name, mb in (o.peak_rss_mb or {}).items():
        bound = GOAL["gateway_rss_mb_max"] if name == "gateway" else GOAL["backend_rss_mb_max"]
        if not mb < bound:  # NaN (unreadable) is not under it
            return False
    return True


def _fmt(seconds: float | None) -> str:
    return "failed" if seconds is None else f"{seconds * 1000:.0f} ms"


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="kumo bench attack", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True)
    p.add_argument("--account", required=True, help="the attacking tenant's account id")
    p.add_argument("--token", required=True)
    p.add_argument("--victim-account", required=True)
    p.add_argument("--victim-token", required=True)
    p.add_argument("--model", default="@cf/zai-org/glm-5.2", help="the victim's (and text attacks') model")
    p.add_argument("--vision-model", default="@cf/moonshotai/kimi-k2.6")
    p.add_argument("--only", default=",".join(ATTACKS), help="comma-separated attacks to run")
    p.add_argument("--quick", action="store_true", help="the bounded subset's sizes (CI)")
    p.add_argument("--out", default=None, help="write the results here as JSON")
    p.add_argument(
        "--pid", action="append", default=[], metavar="NAME=PID",
        help="a process on this machine whose peak RSS to record per attack (gateway, backends)",
    )  # fmt: skip
    args = p.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in ATTACKS]
    if unknown:
        p.error(f"unknown attacks {unknown}; known: {', '.join(ATTACKS)}")
    target = Target(
        url=args.url.rstrip("/"), account=args.account, token=args.token,
        victim_account=args.victim_account, victim_token=args.victim_token,
        model=args.model, vision_model=args.vision_model, quick=args.quick,
    )  # fmt: skip
    try:
        pids = {name: int(pid) for name, _, pid in (w.partition("=") for w in args.pid)}
    except ValueError:
        p.error("--pid takes NAME=PID")
    unloaded, outcomes = asyncio.run(run(target, names, pids))
    if args.out:
        attacks = [
            {**asdict(o), "victim_ratio": o.victim_s / unloaded if o.victim_s and unloaded else None,
             "goal_met": goal_met(o, unloaded)}
            for o in outcomes
        ]  # fmt: skip
        record = {"unloaded_victim_s": unloaded, "goal": GOAL, "attacks": attacks}
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    return 0 if unloaded is not None and all(o.held for o in outcomes) else 1

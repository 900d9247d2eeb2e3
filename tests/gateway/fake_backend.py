"""A scripted stand-in for `kumo backend`, speaking the internal protocol over real HTTP.

Used only for what a real backend cannot be made to do on demand: crash mid-stream, be slow, be
busy, overflow its context, disagree with the catalog. The last user message picks the script
(`tool:`, `think:`, `json:`, `crash`, `slow`, `crash-one` (the first such stream crashes after its first
piece, later ones are slow), `prefill` (nothing at all, not even the status, for 1.5 s: a real
backend prefilling a long prompt; then an echo), `pause:` (10 ms, then an echo), `overflow`, `busy`, `garbage`, `truncated`,
`logprobs`; anything else is echoed back in pieces). Every request it receives is kept for assertions.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from schemas import backend as b


def last_user_text(req: b.GenerateRequest) -> str:
    if req.prompt is not None:
        return req.prompt
    for m in reversed(req.messages or []):
        if m.role == "user":
            if isinstance(m.content, str):
                return m.content
            return "".join(p.text for p in m.content or [] if isinstance(p, b.TextPart))
    return ""


def pieces(text: str, size: int = 3) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


@dataclass
class FakeBackend:
    name: str
    secret: str = "fake-secret"
    architecture: str = "KimiK25ForConditionalGeneration"
    vision: bool = True
    context_window: int = 4096
    is_down: bool = False
    num_waiting: int = 0  # reported in /v1/load, to steer the router
    requests: list[b.GenerateRequest] = field(default_factory=list)
    journal: list[b.GenerateRequest] = field(
        default_factory=list
    )  # shared by a harness's backends, in arrival order
    num_open_streams: int = 0
    num_crash_one: int = 0  # `crash-one` streams begun

    def card(self) -> b.ModelCard:
        return b.ModelCard(
            name=self.name,
            architecture=self.architecture,
            family="kimi" if "Kimi" in self.architecture else "glm",
            weights="float32",
            kv_dtype="float32",
            context_window=self.context_window,
            page_size=16,
            num_pages=256,
            capabilities=b.Capabilities(vision=self.vision),
        )

    def app(self) -> Starlette:
        def guarded(handler):  # type: ignore[no-untyped-def]
            async def run(request: Request) -> Response:
                if request.headers.get("authorization") != f"Bearer {self.secret}":
                    body = b.ErrorBody(error=b.Error(code="unauthorized", message="bad secret", status=401))
                    return Response(msgspec.json.encode(body), status_code=401)
                if self.is_down:
                    return Response(b"down", status_code=503)
                return await handler(request)

            return run

        async def model(request: Request) -> Response:
            return Response(msgspec.json.encode(self.card()), media_type="application/json")

        async def load(request: Request) -> Response:
            report = b.LoadReport(
                waiting=self.num_waiting, running=self.num_open_streams, free_pages=200, total_pages=256
            )
            return Response(msgspec.json.encode(report), media_type="application/json")

        async def health(request: Request) -> Response:
            return Response(msgspec.json.encode(b.Health(status="ok")), media_type="application/json")

        async def generate(request: Request) -> Response:
            req = msgspec.json.decode(await request.body(), type=b.GenerateRequest)
            self.requests.append(req)
            self.journal.append(req)
            text = last_user_text(req)
            if text == "busy":
                body = b.ErrorBody(error=b.Error(code="busy", message="full", status=429))
                return Response(msgspec.json.encode(body), status_code=429)
            if text == "prefill":
                await asyncio.sleep(1.5)
            if text == "overflow":
                body = b.ErrorBody(
                    error=b.Error(
                        code="context_window_exceeded",
                        message="The estimated number of input and maximum output tokens (9000) exceeded this model context window limit (4096).",
                        status=413,
                    )
                )
                return Response(msgspec.json.encode(body), status_code=413)
            return StreamingResponse(self._events(req, text), media_type="application/x-ndjson")

        return Starlette(
            routes=[
                Route("/v1/model", guarded(model)),
                Route("/v1/load", guarded(load)),
                Route("/v1/health", guarded(health)),
                Route("/v1/generate", guarded(generate), methods=["POST"]),
            ]
        )

    async def _events(self, req: b.GenerateRequest, text: str) -> AsyncIterator[bytes]:
        self.num_open_streams += 1
        try:
            if text == "truncated":  # a clean end without usage or finish
                yield msgspec.json.encode(b.TextDelta(text="half")) + b"\n"
                return
            if text == "garbage":
                yield b'{"type": "text", "text": "ok"}\n{not json\n'
                return
            crashes = False
            if text == "crash-one":
                crashes, self.num_crash_one = self.num_crash_one == 0, self.num_crash_one + 1
            if text.startswith("pause:"):  # a short real wait, then the echo: work that takes time
                await asyncio.sleep(0.01)
            for i, event in enumerate(self._script(req, text)):
                if isinstance(event, b.Started):  # as a real backend: with the first output's events
                    pass
                elif text == "slow" or (text == "crash-one" and not crashes):
                    await asyncio.sleep(0.3)
                if crashes and i == 2:  # after `Started` and one delta
                    raise ConnectionResetError("scripted crash mid-stream, beside a slow choice")
                if text == "crash" and isinstance(event, b.Usage):
                    raise ConnectionResetError("scripted crash mid-stream")
                yield msgspec.json.encode(event) + b"\n"
        finally:
            self.num_open_streams -= 1

    def _script(self, req: b.GenerateRequest, text: str) -> list[b.Event]:
        events: list[b.Event] = []
        finish: b.FinishReason = "stop"
        if text.startswith("think:"):
            events += [b.ReasoningDelta(text=p) for p in pieces("Let me think.")]
            text = text.removeprefix("think:")
        if text.startswith("tool:"):
            events.append(
                b.ToolCallDelta(index=0, id="call_abc123xyz", name="get_weather", arguments='{"city": ')
            )
            events.append(b.ToolCallDelta(index=0, arguments='"Lisbon"}'))
            if req.parallel_tool_calls:
                events.append(
                    b.ToolCallDelta(
                        index=1, id="call_def456uvw", name="get_weather", arguments='{"city": "Porto"}'
                    )
                )
            finish = "tool_calls"
        elif text.startswith("json:"):
            events += [b.TextDelta(text=p) for p in pieces('{"answer": 42, "ok": true}')]
        elif text.startswith("logprobs"):
            for p in pieces("abcdef"):
                top = [
                    b.TopLogprob(token=p, token_id=1, logprob=-0.1),
                    b.TopLogprob(token="zz", token_id=2, logprob=-2.5),
                ]
                lp = b.TokenLogprob(token=p, token_id=1, logprob=-0.1, top=top[: req.sampling.top_logprobs])
                events.append(b.TextDelta(text=p, logprobs=[lp] if req.sampling.logprobs else None))
            # "€" over two tokens, as a real backend sends them (text alone U+FFFD, bytes their own; the
            # tokens above carry no bytes, as from an older backend): the first token's text is held back
            for i, (raw, text_after) in enumerate([(b"\xe2\x82", ""), (b"\xac", "€")]):
                lp = b.TokenLogprob(token="\ufffd", token_id=3 + i, logprob=-0.7, token_bytes=raw)
                events.append(b.TextDelta(text=text_after, logprobs=[lp] if req.sampling.logprobs else None))
        else:
            reply = f"echo[{req.sampling.seed}]: {text}" if req.sampling.seed is not None else f"echo: {text}"
            events += [b.TextDelta(text=p) for p in pieces(reply)]
        num_prompt = 7 + len(text)
        num_reasoning = sum(isinstance(e, b.ReasoningDelta) for e in events)  # a token an event
        events.append(
            b.Usage(
                prompt_tokens=num_prompt,
                completion_tokens=len(events),
                cached_tokens=min(num_prompt, 4),
                reasoning_tokens=num_reasoning,
            )
        )
        events.append(b.Finish(reason=finish))
        # first, as a real backend sends it: the prompt's count (what a cut choice is billed)
        return [b.Started(prompt_tokens=num_prompt, cached_tokens=min(num_prompt, 4)), *events]


@dataclass
class Served:
    server: uvicorn.Server
    task: asyncio.Task[None]
    url: str

    async def stop(self) -> None:
        self.server.should_exit = True
        await self.task


async def serve(app: object, host: str = "127.0.0.1", config: uvicorn.Config | None = None) -> Served:
    """Run an ASGI app under uvicorn on a free port of `host`, in this event loop (`config`: the
    server's own configuration, e.g. the gateway's guarded one, its address replaced)."""
    if config is None:
        config = uvicorn.Config(app, host=host, port=0, log_level="warning", lifespan="on", ws="none")  # type: ignore[arg-type]
    else:
        config.host, config.port = host, 0
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()
        await asyncio.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return Served(server, task, f"http://{host}:{port}")

"""Backend events → the caller's format (DESIGN §2 step 8).

`Completion` accumulates one choice's events. Non-streaming answers are built from completions:
the legacy `{response, tool_calls, usage}` (tool arguments as objects; in JSON mode `response` is
the parsed object) or an OpenAI `chat.completion`. Streams are rendered frame by frame: legacy
frames carry the random `p` padding; OpenAI chunks end with a finish chunk, then the Workers AI
usage trailer on `/ai/run` (or OpenAI's usage chunk when asked for), then `[DONE]`.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
from msgspec import UNSET

from gateway.backend_client import to_gateway_error
from gateway.errors import BadInput, KumoError
from schemas import backend as b
from schemas import openai as o
from schemas.workers_ai import (
    LegacyFrame,
    LegacyResult,
    LegacyToolCall,
    LegacyUsage,
    PromptTokensDetails,
    Trailer,
)

DONE = b"data: [DONE]\n\n"
_FINISH: dict[str, o.FinishReasonOut] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "abort": "stop",
}


def sse(payload: msgspec.Struct | dict[str, object]) -> bytes:
    return b"data: " + msgspec.json.encode(payload) + b"\n\n"


def padding() -> str:
    """Random-length random padding for the `p` field (token-length side channel, §1.5)."""
    return secrets.token_urlsafe(secrets.randbelow(24) + 1)[: secrets.randbelow(16) + 1]


@dataclass
class ToolCallParts:
    id: str
    name: str
    arguments: str = ""


@dataclass
class Completion:
    """One choice's events, accumulated. `feed` raises the mapped error on an error event."""

    text: str = ""
    reasoning: str = ""
    tool_calls: dict[int, ToolCallParts] = field(default_factory=dict)
    logprobs: list[b.TokenLogprob] = field(default_factory=list)
    usage: b.Usage | None = None
    started: b.Started | None = None  # the backend's count of the prompt, its first event
    finish: o.FinishReasonOut | None = None
    # the backend took the choice on: an event came, or the wait for one was cut while a replica held
    # it (`backend_client.Dispatch`)
    is_started: bool = False
    num_pieces: int = 0  # delta events fed: each carries at least one generated token
    # a stream's events as read from the backend, ahead of the client (`inference.merge`)
    num_read: int = 0  # delta events
    usage_read: b.Usage | None = None

    def note_read(self, event: b.Event) -> None:
        """An event read from the backend, not yet fed (the client has not taken it)."""
        if isinstance(event, b.TextDelta | b.ReasoningDelta | b.ToolCallDelta):
            self.num_read += 1
        elif isinstance(event, b.Usage):
            self.usage_read = event

    def feed(self, event: b.Event) -> None:
        if isinstance(event, b.TextDelta | b.ReasoningDelta | b.ToolCallDelta):
            self.num_pieces += 1
        if isinstance(event, b.TextDelta):
            self.text += event.text
            self.logprobs.extend(event.logprobs or [])
        elif isinstance(event, b.ReasoningDelta):
            self.reasoning += event.text
        elif isinstance(event, b.ToolCallDelta):
            call = self.tool_calls.setdefault(
                event.index, ToolCallParts(id=event.id or f"call_{event.index}", name="")
            )
            call.name = event.name or call.name
            call.arguments += event.arguments
        elif isinstance(event, b.Usage):
            self.usage = event
        elif isinstance(event, b.Started):
            self.started = event
        elif isinstance(event, b.Finish):
            self.finish = _FINISH[event.reason]
        else:
            raise to_gateway_error(event)

    def consumed(self, prompt_tokens: int) -> b.Usage:
        """What the choice cost: the backend's usage, which it sends only at the end. A choice cut
        before then (the client gone, a timeout, a drain, an error mid-stream) is billed instead,
        once the backend took it on, its prompt (as the backend counted it in `Started`, else
        `prompt_tokens`, admission's estimate) and a token per piece delivered (a lower bound), so
        that ending a stream early never makes it free.
        Cut before its first event, it is billed the prompt if a replica held it then: a backend
        says nothing until its prompt is in, and the pages it prefilled stay in the tenant's prefix
        cache, so a deadline set just short of the first event must not buy the prefill for free.
        A stream's pieces count as delivered once read from the backend (`note_read`), ahead of the
        client, and its usage once read: the client's pace does not change the bill."""
        usage = self.usage if self.usage is not None else self.usage_read
        if usage is not None:
            return usage
        if not self.is_started:  # refused, never routed, or cut before a replica had it: no work done
            return b.Usage(prompt_tokens=0, completion_tokens=0)
        completion_tokens = max(self.num_pieces, self.num_read, len(self.logprobs))
        if self.started is not None:
            s = self.started
            return b.Usage(
                prompt_tokens=s.prompt_tokens,
                cached_tokens=s.cached_tokens,
                completion_tokens=completion_tokens,
            )
        return b.Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)

    def check_finished(self) -> None:
        """A backend stream that ended without a finish event was cut short: an error, not an answer."""
        if self.finish is None:
            raise KumoError("Unknown internal error")


@dataclass(frozen=True)
class Totals:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    reasoning_tokens: int = 0  # of the completion tokens, the reasoning block's (every choice's)

    @classmethod
    def of(cls, completions: list[Completion], prompt_estimate: int = 0) -> Totals:
        """Every choice is its own backend request on one replica: choice 0's prompt is counted
        whole, each later choice's only where the replica's prefix cache did not serve it (choices
        prefilled at once compute it again). Completions are summed over choices. A choice cut
        before its usage came counts `Completion.consumed`, the prompt estimate on choice 0 only
        (a later one shares its prompt)."""
        if not completions:
            return cls(prompt_tokens=0, cached_tokens=0, completion_tokens=0)
        first, *rest = (c.consumed(prompt_estimate if i == 0 else 0) for i, c in enumerate(completions))
        return cls(
            prompt_tokens=first.prompt_tokens + sum(u.prompt_tokens - u.cached_tokens for u in rest),
            cached_tokens=first.cached_tokens,
            completion_tokens=first.completion_tokens + sum(u.completion_tokens for u in rest),
            reasoning_tokens=first.reasoning_tokens + sum(u.reasoning_tokens for u in rest),
        )

    def legacy(self, neurons: float | None = None) -> LegacyUsage:
        return LegacyUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            neurons=UNSET if neurons is None else round(neurons, 4),
        )

    def openai(self) -> o.CompletionUsage:
        return o.CompletionUsage(
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            total_tokens=self.prompt_tokens + self.completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=self.cached_tokens),
            # always, 0 too, as OpenAI does (and as the Responses API's usage says)
            completion_tokens_details=o.CompletionTokensDetails(reasoning_tokens=self.reasoning_tokens),
        )


NeuronsOf = Callable[[Totals], float]  # prices totals for the usage trailer (the route knows the price list)


# ---- non-streaming -------------------------------------------------------------------------------------
def legacy_result(c: Completion, totals: Totals, *, json_mode: bool) -> LegacyResult:
    response: object = c.text
    if json_mode and not c.tool_calls:  # an answer that calls tools has no JSON to give
        try:
            response = msgspec.json.decode(c.text)
        except msgspec.DecodeError as exc:
            raise BadInput("JSON Mode couldn't be met") from exc
    calls = _legacy_calls(c)
    return LegacyResult(response=response, tool_calls=calls or UNSET, usage=totals.legacy())


def chat_completion(
    completions: list[Completion], totals: Totals, *, model: str, id: str, created: int, logprobs: bool
) -> o.ChatCompletion:
    choices = []
    for i, c in enumerate(completions):
        calls = [
            o.ToolCallOut(id=t.id, function=o.FunctionCallOut(name=t.name, arguments=t.arguments))
            for _, t in sorted(c.tool_calls.items())
        ]
        message = o.MessageOut(
            content=c.text or (None if calls else ""),
            reasoning_content=c.reasoning or None,
            tool_calls=calls or UNSET,
        )
        finish: o.FinishReasonOut = (
            "tool_calls" if calls and c.finish in (None, "stop", "tool_calls") else (c.finish or "stop")
        )
        choices.append(
            o.Choice(
                index=i,
                message=message,
                finish_reason=finish,
                logprobs=_logprobs(c.logprobs) if logprobs else None,
            )
        )
    return o.ChatCompletion(id=id, created=created, model=model, choices=choices, usage=totals.openai())


def _legacy_calls(c: Completion) -> list[LegacyToolCall]:
    """The legacy shape of a choice's tool calls: arguments as an object, no id, no type."""
    return [
        LegacyToolCall(name=t.name, arguments=_arguments_object(t.arguments))
        for _, t in sorted(c.tool_calls.items())
    ]


def _arguments_object(text: str) -> object:
    try:
        return msgspec.json.decode(text) if text else {}
    except msgspec.DecodeError:
        return text


def _logprobs(items: list[b.TokenLogprob]) -> o.ChoiceLogprobs:
    return o.ChoiceLogprobs(
        content=[
            o.TokenLogprobOut(
                token=t.token,
                logprob=t.logprob,
                bytes=_bytes(t),
                top_logprobs=[
                    o.TopLogprobOut(token=x.token, logprob=x.logprob, bytes=_bytes(x)) for x in t.top
                ],
            )
            for t in items
        ]
    )


def _bytes(t: b.TokenLogprob | b.TopLogprob) -> list[int]:
    """The token's own bytes, so that a client joining consecutive tokens' rebuilds a character they
    split (the token's text alone is U+FFFD there); a backend that sends none: its text's."""
    return list(t.token.encode() if t.token_bytes is None else t.token_bytes)


# ---- streaming -----------------------------------------------------------------------------------------
async def legacy_stream(
    events: AsyncIterator[tuple[int, b.Event]], done: list[Completion], neurons_of: NeuronsOf
) -> AsyncIterator[bytes]:
    """Legacy SSE: a frame per text piece, the tool calls (object arguments) once complete, a usage
    frame with `response: ""`, then `[DONE]`."""
    c = done[0]
    async for _, event in events:
        c.feed(event)
        if isinstance(event, b.TextDelta) and event.text:
            yield sse(LegacyFrame(response=event.text, p=padding()))
    if c.tool_calls:
        yield sse(LegacyFrame(response="", tool_calls=_legacy_calls(c), p=padding()))
    for c in done:
        c.check_finished()
    totals = Totals.of(done)
    yield sse(LegacyFrame(response="", usage=totals.legacy(neurons_of(totals))))
    yield DONE


async def openai_stream(
    events: AsyncIterator[tuple[int, b.Event]],
    done: list[Completion],
    *,
    model: str,
    id: str,
    created: int,
    logprobs: bool,
    workers_trailer: bool,
    include_usage: bool,
    neurons_of: NeuronsOf,
) -> AsyncIterator[bytes]:
    """OpenAI chunks for n merged choices. On `/ai/run` (workers_trailer) chunks carry `p` and the
    Workers AI usage trailer follows; `include_usage` adds OpenAI's `choices: []` usage chunk."""

    def chunk(i: int, delta: o.Delta, finish: str | None = None, lp: o.ChoiceLogprobs | None = None) -> bytes:
        choice = o.ChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=lp)
        return sse(
            o.ChatCompletionChunk(
                id=id,
                created=created,
                model=model,
                choices=[choice],
                p=padding() if workers_trailer else UNSET,
            )
        )

    for i in range(len(done)):
        yield chunk(i, o.Delta(role="assistant", content=""))
    async for i, event in events:
        c = done[i]
        c.feed(event)
        if isinstance(event, b.TextDelta) and (event.text or (logprobs and event.logprobs)):
            # logprobs may come without text (the backend sends a token's once its text is out,
            # which can be in an earlier delta): a chunk for them, as in the whole answer
            yield chunk(
                i, o.Delta(content=event.text), lp=_logprobs(event.logprobs or []) if logprobs else None
            )
        elif isinstance(event, b.ReasoningDelta) and event.text:
            yield chunk(i, o.Delta(reasoning_content=event.text))
        elif isinstance(event, b.ToolCallDelta):
            fn = o.FunctionCallOut(name=event.name, arguments=event.arguments)
            yield chunk(i, o.Delta(tool_calls=[o.ToolCallChunk(index=event.index, id=event.id, function=fn)]))
        elif isinstance(event, b.Finish):
            finish = "tool_calls" if c.tool_calls and c.finish == "stop" else c.finish
            yield chunk(i, o.Delta(), finish=finish)
    for c in done:
        c.check_finished()
    totals = Totals.of(done)
    if include_usage:
        yield sse(
            o.ChatCompletionChunk(id=id, created=created, model=model, choices=[], usage=totals.openai())
        )
    if workers_trailer:
        yield sse(Trailer(response="", usage=totals.legacy(neurons_of(totals))))
    yield DONE


def stream_error(error: KumoError, *, openai: bool) -> bytes:
    """An error after the stream began: OpenAI's in-stream `error` object (its SDK raises on it) or
    the Workers AI error list; the stream then ends without `[DONE]`."""
    if openai:
        return sse({"error": {"message": error.wire_message, "type": "server_error", "code": error.code}})
    return sse({"success": False, "errors": [{"code": error.code, "message": error.wire_message}]})

"""One request's engine outputs → internal-protocol events (DESIGN.md §2 step 7).

Token ids flow: reasoning split (on `<think>` ids) → the content channel goes through the family's
tool-call parser → answer ids are detokenized incrementally → string stops are matched on the answer
text. Each channel has its own detokenizer, so a character is never split and markers never leak
into text. Special tokens other than markers (a stray `<|im_end|>`) are not text, and neither are the
newlines before the answer's first character (GLM's `</think>\n`).

Logprobs, when asked for, are the answer's: `logprobs.content` as OpenAI defines it, one entry per
token of the content, sent once the token's text is (a token whose text is held back, part of a
character or of a possible stop string, waits; one past a stop string never goes). Reasoning
tokens, the think and tool-call markers, other special tokens, the newlines dropped before the
answer and the tokens of a parsed tool call have none (a malformed call that comes back as text
has its tokens'), so that the entries' bytes, joined, are the content's (sglang#25055 is the bug
where they are not).

String stops: the engine speaks ids, so stop strings are matched here. Text that could still turn
into a stop string is held back; once one matches, the text before it is sent and the request ends
with reason `stop` (the caller aborts the engine side).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import msgspec

from backend.text.detokenizer import Detokenizer
from backend.text.reasoning import Channel, ReasoningParser
from backend.text.tokenizer import Tokenizer
from backend.text.tool_parsers import ContentIds, ParsedCall, RawText, ToolParser
from backend.text.tool_parsers.base import Fed, Piece
from schemas.backend import (
    EngineOutput,
    Error,
    Event,
    Finish,
    FinishReason,
    ReasoningDelta,
    TextDelta,
    TokenLogprob,
    ToolCallDelta,
    TopLogprob,
    Usage,
)

_Logprob = TypeVar("_Logprob", TokenLogprob, TopLogprob)


class StopMatcher:
    """Finds the first stop string in a text stream, holding back what may be the start of one."""

    def __init__(self, stops: list[str]) -> None:
        self._stops = stops
        self._held = ""

    def push(self, text: str) -> tuple[str, bool]:
        """(text safe to send, whether a stop string matched)."""
        buffer = self._held + text
        hits = [i for i in (buffer.find(s) for s in self._stops) if i >= 0]
        if hits:
            self._held = ""
            return buffer[: min(hits)], True
        cut = len(buffer) - self._partial_stop(buffer)
        self._held = buffer[cut:]
        return buffer[:cut], False

    def _partial_stop(self, buffer: str) -> int:
        """Length of the longest end of `buffer` that begins some stop string."""
        longest = 0
        for stop in self._stops:
            for k in range(min(len(stop) - 1, len(buffer)), longest, -1):
                if buffer.endswith(stop[:k]):
                    longest = k
                    break
        return longest

    def flush(self) -> str:
        held, self._held = self._held, ""
        return held


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        reasoning: ReasoningParser | None,
        tools: ToolParser | None,
        stops: list[str],
        skip_ids: frozenset[int],
    ) -> None:
        self._tokenizer = tokenizer
        self._reasoning = reasoning
        self._tools = tools
        self._stops = StopMatcher(stops)
        self._skip_ids = skip_ids  # special ids that are neither text nor markers
        self._detok: dict[Channel, Detokenizer] = {
            "reasoning": Detokenizer(tokenizer),
            "content": Detokenizer(tokenizer),
        }
        self.is_stopped = False  # a stop string ended the answer
        self._is_answer_started = False  # newlines before the answer's first character are dropped
        # the engine sends prompt log-probs with the first token; usage goes out with the last
        self._prompt_logprobs: list[TokenLogprob | None] | None = None
        self._fed: list[Fed | None] = []  # this output's content ids, in order: what each did (None: text)
        self._held: list[TokenLogprob] = []  # logprobs of the ids an open tool call holds
        self._released: list[TokenLogprob] = []  # `_finish`: held logprobs whose call came back as text
        self._is_logprob_started = False  # an answer token's logprob kept (`_past_leading_newlines`)
        self._queued: list[TokenLogprob] = []  # kept logprobs whose text has not gone out yet
        self._text_bytes = 0  # UTF-8 bytes of the answer text sent so far
        self._logprob_bytes = 0  # and of the tokens whose logprobs were sent

    def process(self, out: EngineOutput) -> list[Event]:
        """Events for one engine output, ending with usage + finish (or an error) on the last one."""
        events: list[Event] = []
        if out.prompt_logprobs is not None:
            self._prompt_logprobs = [lp if lp is None else self._named(lp) for lp in out.prompt_logprobs]
        self._fed = []
        channels: list[Channel | None] = []
        if not self.is_stopped:
            runs = (
                self._reasoning.split(out.token_ids)
                if self._reasoning
                else [("content", list(out.token_ids))]
            )
            channels = self._reasoning.channels if self._reasoning else ["content"] * len(out.token_ids)
            for channel, ids in runs:
                ids = [i for i in ids if i not in self._skip_ids]
                if channel == "reasoning":
                    self._reasoning_text(self._detok["reasoning"].push(ids), events)
                else:
                    self._content(ids, events)
                if self.is_stopped:
                    break
        logprobs = self._answer_logprobs(out, channels) if out.logprobs else []
        last_two: list[Event] = []  # usage, then finish or error: after the answer and its logprobs
        is_last = out.finish_reason is not None or self.is_stopped
        if is_last:
            *events_, usage, end = self._finish(out)
            events += events_
            last_two = [usage, end]
            logprobs += self._released  # a call left open at the end, back as text
        self._queued += [self._named(lp) for lp in self._past_leading_newlines(logprobs)]
        self._text_bytes += sum(len(e.text.encode()) for e in events if isinstance(e, TextDelta))
        ready = self._ready_logprobs(is_last)
        if ready:
            last = events[-1] if events else None
            if isinstance(last, TextDelta) and last.logprobs is None:
                events[-1] = TextDelta(text=last.text, logprobs=ready)
            else:
                events.append(TextDelta(text="", logprobs=ready))
        return events + last_two

    def _past_leading_newlines(self, logprobs: list[TokenLogprob]) -> list[TokenLogprob]:
        """`logprobs` (in the text's order) less the newline tokens before the answer's first
        character, which `_text` drops, whichever way they came (at once, or in a call back as text)."""
        kept = []
        for lp in logprobs:
            if self._is_logprob_started or not self._is_newlines(lp.token_id):
                self._is_logprob_started = True
                kept.append(lp)
        return kept

    def _ready_logprobs(self, is_last: bool) -> list[TokenLogprob]:
        """The queued logprobs whose tokens' bytes the text sent so far covers: a token whose text is
        held back (part of a character, or of what may be a stop string) waits for it, and one past
        a stop string never goes (its text never does). At the end, without a stop, the rest go."""
        sends_all = is_last and not self.is_stopped
        n = 0
        for lp in self._queued:
            size = len(lp.token_bytes or b"")
            if self._logprob_bytes + size > self._text_bytes and not sends_all:
                break
            self._logprob_bytes += size
            n += 1
        ready, rest = self._queued[:n], self._queued[n:]
        self._queued = [] if is_last else rest
        return ready

    def _answer_logprobs(self, out: EngineOutput, channels: list[Channel | None]) -> list[TokenLogprob]:
        """The logprobs of this output's answer tokens (the module docstring): the content channel's
        ids, less the special ones, as the tool parser passed them to the text."""
        assert out.logprobs is not None
        by_position = out.logprobs  # the engine's, one per generated id (a test may send fewer)
        fed = iter(self._fed)
        kept: list[TokenLogprob] = []
        for i, token_id in enumerate(out.token_ids):
            if i >= len(channels) or channels[i] != "content" or token_id in self._skip_ids:
                continue
            try:
                what = next(fed)
            except StopIteration:  # after a stop string: never parsed
                break
            lp = by_position[i] if i < len(by_position) else None
            if what is None or what.is_content:
                if lp is not None:
                    kept.append(lp)
                continue
            if lp is not None:
                self._held.append(lp)
            kept += self._settle(what.pieces)
            if what.is_idle:  # what it held and did not return as text (layout, markers) is gone
                self._held = []
        return kept

    def _settle(self, pieces: Sequence[Piece]) -> list[TokenLogprob]:
        """The held logprobs that `pieces` (calls and texts completed by one id) return as text: a
        malformed call's text takes those of its `source_ids`, in order (held ids between them,
        layout and markers, are dropped); a parsed call takes everything held before it."""
        kept: list[TokenLogprob] = []
        for piece in pieces:
            if isinstance(piece, ParsedCall):
                self._held = []
            elif isinstance(piece, RawText):
                held, at = self._held, 0
                for source_id in piece.source_ids:
                    match = next((j for j in range(at, len(held)) if held[j].token_id == source_id), None)
                    if match is not None:
                        kept.append(held[match])
                        at = match + 1
                self._held = held[at:]
        return kept

    def _is_newlines(self, token_id: int) -> bool:
        """A token of newlines alone, which `_text` drops before the answer's first character."""
        spelled = self._tokenizer.token_bytes(token_id)
        return bool(spelled) and not spelled.strip(b"\n")

    def _content(self, ids: list[int], events: list[Event]) -> None:
        if self._tools:
            pieces = self._tools.feed(ids)
            self._fed += self._tools.trace
        else:
            pieces = [ContentIds(ids)]
            self._fed += [None] * len(ids)
        for piece in pieces:
            if isinstance(piece, ContentIds):
                self._text(self._detok["content"].push(piece.token_ids), events)
            elif isinstance(piece, RawText):
                self._text(self._detok["content"].flush() + piece.text, events)
            elif isinstance(piece, ParsedCall):
                self._text(self._detok["content"].flush(), events)
                if self.is_stopped:
                    return
                held = self._stops.flush()  # no stop string spans a call: what waited goes before it
                if held:
                    events.append(TextDelta(text=held))
                events.append(
                    ToolCallDelta(index=piece.index, id=piece.id, name=piece.name, arguments=piece.arguments)
                )
            if self.is_stopped:
                return

    def _text(self, text: str, events: list[Event]) -> None:
        if not self._is_answer_started:
            # the template's separator after `</think>` (GLM writes `</think>\n`), not the answer's
            text = text.lstrip("\n")
            self._is_answer_started = bool(text)
        if not text or self.is_stopped:
            return
        safe, self.is_stopped = self._stops.push(text)
        if safe:
            events.append(TextDelta(text=safe))

    @staticmethod
    def _reasoning_text(text: str, events: list[Event]) -> None:
        if text:
            events.append(ReasoningDelta(text=text))

    def _named(self, lp: TokenLogprob) -> TokenLogprob:
        """Logprobs carry each token's text and bytes; fill what the engine left out. The bytes are the
        token's own, so joining them rebuilds a character split over tokens (whose text alone is
        U+FFFD)."""
        return msgspec.structs.replace(self._spelled(lp), top=[self._spelled(t) for t in lp.top])

    def _spelled(self, lp: _Logprob) -> _Logprob:
        tokenizer = self._tokenizer
        return msgspec.structs.replace(
            lp,
            token=lp.token or tokenizer.decode([lp.token_id]),
            token_bytes=tokenizer.token_bytes(lp.token_id) if lp.token_bytes is None else lp.token_bytes,
        )

    def _finish(self, out: EngineOutput) -> list[Event]:
        events: list[Event] = []
        self._released = []
        if not self.is_stopped:
            self._reasoning_text(self._detok["reasoning"].flush(), events)
            if self._tools:
                finished = self._tools.finish()
                self._released = self._settle(finished)
                for piece in finished:
                    if isinstance(piece, RawText):
                        self._text(self._detok["content"].flush() + piece.text, events)
            self._text(self._detok["content"].flush(), events)
            if not self.is_stopped:
                tail = self._stops.flush()
                if tail:
                    events.append(TextDelta(text=tail))
        events.append(
            Usage(
                prompt_tokens=out.num_prompt_tokens,
                completion_tokens=out.num_output_tokens,
                cached_tokens=out.num_cached_tokens,
                reasoning_tokens=self._reasoning.num_reasoning_tokens if self._reasoning else 0,
                prompt_logprobs=self._prompt_logprobs,
            )
        )
        if out.error is not None and not self.is_stopped:
            return [*events, Error(code=out.error.code, message=out.error.message, status=out.error.status)]
        events.append(Finish(reason=self._reason(out.finish_reason)))
        return events

    def _reason(self, engine_reason: FinishReason | None) -> FinishReason:
        if self.is_stopped:
            return "stop"
        if self._tools is not None and self._tools.num_calls and engine_reason == "stop":
            return "tool_calls"
        return engine_reason or "stop"

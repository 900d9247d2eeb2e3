"""The hook through which constrained decoding (JSON mode, forced tool calls) reaches the sampler.

The engine keeps one `TokenConstraint` per constrained request; the batched sampler asks each for the
allowed-token mask of the next step, so constrained and free requests share a batch. Beside it a
request may have a `TokenGuard`, which keeps a few ids out of its output: end-of-turn inside an open
reasoning block, tool-call markers where no tool may be called.
"""

from __future__ import annotations

from typing import Protocol

import torch

from schemas.backend import EngineRequest


class TokenConstraint(Protocol):
    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        """A `[vocab_size]` bool mask of tokens allowed next, or None when anything goes."""
        ...

    def accept(self, token_id: int) -> None:
        """Advance past a sampled token."""
        ...

    def is_finished(self) -> bool:
        """True once the constrained output is complete; the request should then stop."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last accepted tokens (preemption by recompute replays them)."""
        ...


class TokenGuard:
    """Keeps ids out of a request's output without a grammar (issue 26): a few ids per row, which
    the sampler masks and a speculative step masks along its drafts.

    Two kinds of id. `always`: never sampled (the family's tool-call markers where no tool may be
    called, so an unoffered call cannot open and leak its markup into the text). The reasoning
    block's `stop_ids`: banned while the block is open (its start marker was the last marker seen,
    in the prompt or the output), so the model has to write the end marker before it can stop; once
    the block is closed they are allowed, until a start marker opens one again (as
    `backend.text.reasoning.ReasoningParser` reads them). It only masks, never forces a token, so
    `max_tokens` still ends a request inside the block ("length").

    The engine holds it beside the request's `TokenConstraint` rather than as one: its state follows
    from the marker ids alone, so a speculative step masks each verify row along the drafts
    (`banned_along`) and the request keeps drafting, and its mask is a few ids, not a vocabulary-wide
    host tensor per step. It still answers the `TokenConstraint` protocol.
    """

    def __init__(
        self,
        start_id: int | None,
        end_id: int | None,
        stop_ids: list[int],
        *,
        is_open: bool,
        call_start_id: int | None = None,
        always: tuple[int, ...] = (),
    ) -> None:
        """`start_id`/`end_id` None: no reasoning block (only `always` is banned).
        `call_start_id`: a tool call's opening marker, which closes the block too (tools offered)."""
        self.start_id, self.end_id, self.call_start_id = start_id, end_id, call_start_id
        self.stop_ids = tuple(stop_ids) if start_id is not None else ()
        self.always = always
        self._if_open = (*self.stop_ids, *(t for t in always if t not in self.stop_ids))
        self._markers_ids = {t for t in (start_id, end_id, call_start_id) if t is not None}
        self._was_open = is_open and start_id is not None  # before the first accepted token
        self._num_tokens = 0
        self._markers: list[tuple[int, bool]] = []  # (token index, opens) of each accepted marker
        self._mask: torch.Tensor | None = None
        self._mask_open: bool | None = None

    @classmethod
    def of(cls, request: EngineRequest) -> TokenGuard | None:
        """The guard of a request that reasons or has ids to keep out, or None. A reasoning block
        is guarded only where an end-of-turn id would stop it (not under `ignore_eos`); its own
        `stop_token_ids` stay allowed, as the caller's choice."""
        markers = request.reasoning_markers
        always = tuple(dict.fromkeys(request.banned_token_ids))
        reasons = markers is not None and not request.sampling.ignore_eos and bool(request.eos_token_ids)
        if not reasons and not always:
            return None
        if not reasons or markers is None:
            return cls(None, None, [], is_open=False, always=always)
        return cls(
            markers.start_id,
            markers.end_id,
            request.eos_token_ids,
            is_open=markers.is_open,
            call_start_id=markers.call_start_id,
            always=always,
        )

    @property
    def max_banned(self) -> int:
        """The most ids `banned_ids` returns at any token."""
        return len(self._if_open)

    @property
    def is_open(self) -> bool:
        return self._markers[-1][1] if self._markers else self._was_open

    def banned_ids(self) -> tuple[int, ...]:
        """The ids masked for the next token: `always`, and the stop ids while the block is open."""
        return self._if_open if self.is_open else self.always

    def banned_along(self, token_ids: list[int]) -> list[tuple[int, ...]]:
        """`banned_ids` before each of `token_ids` and after the last (a verify step's rows, the
        drafts as `token_ids`); the guard's state is left as it was."""
        banned = [self.banned_ids()]
        for token_id in token_ids:
            self.accept(token_id)
            banned.append(self.banned_ids())
        self.rollback(len(token_ids))
        return banned

    def allowed_tokens(self, vocab_size: int) -> torch.Tensor | None:
        banned = self.banned_ids()
        if not banned:
            return None
        if self._mask is None or self._mask.shape[0] != vocab_size or self._mask_open != self.is_open:
            mask = torch.ones(vocab_size, dtype=torch.bool)  # [vocab]
            mask[[i for i in banned if i < vocab_size]] = False
            self._mask, self._mask_open = mask, self.is_open
        return self._mask

    def accept(self, token_id: int) -> None:
        if token_id in self._markers_ids:
            self._markers.append((self._num_tokens, token_id == self.start_id))
        self._num_tokens += 1

    def is_finished(self) -> bool:
        return False  # it never ends a request: the model, its stop ids or max_tokens do

    def rollback(self, num_tokens: int) -> None:
        assert 0 <= num_tokens <= self._num_tokens, "rolled back past the first accepted token"
        self._num_tokens -= num_tokens
        while self._markers and self._markers[-1][0] >= self._num_tokens:
            self._markers.pop()

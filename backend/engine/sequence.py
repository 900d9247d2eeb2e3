"""One request as the engine tracks it: its tokens, how far its KV is computed, its page table.

A sequence's page table is the list of (page id, expected tag) pairs that attention reads through
(a row of the block manager's `PageTables`, see `backend.engine.page_table`); the block manager keeps its
own ledger of the same pairs for freeing, so a corrupted table can make a request fail its tag check
but can never leak or double-free a page.
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from backend.engine.page_table import PageRef, PageTable
from backend.engine.sampler import SampleRow
from schemas.backend import EngineRequest, Error, FinishReason, TokenLogprob

if TYPE_CHECKING:
    import torch

    from backend.engine.constraint import TokenConstraint, TokenGuard
    from backend.engine.prefix_cache import PageKey

_arrival = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


__all__ = ["PageRef", "PageTable", "Sequence", "Status"]


@dataclass(eq=False, slots=True)
class Sequence:
    """Token ids are the prompt followed by the output so far; `num_computed_tokens` of them have
    their KV in the cache. After preemption (recompute) it drops to 0 and the whole token list is
    prefilled again; outputs already emitted are never emitted twice."""

    request: EngineRequest
    generator: torch.Generator
    constraint: TokenConstraint | None = None
    guard: TokenGuard | None = None  # keeps a few ids out of its output (see TokenGuard)
    image_embeds: torch.Tensor | None = None  # [sum of image span lengths, hidden]
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache (first admission)
    # speculative decoding: positions below it hold MTP KV of their accepted tokens, or a gap given
    # up (zeros); below `num_whole_draft_kv_tokens`, MTP KV only (backend/engine/speculative/book.py
    # says who writes it, how a gap is caught up and what the prefix cache is told)
    num_draft_kv_tokens: int = 0
    num_whole_draft_kv_tokens: int = 0
    page_table: PageTable = field(default_factory=PageTable)
    page_hashes: list[bytes] = field(default_factory=list)  # chain hashes of full pages held, in order
    num_whole_draft_kv_pages: int = 0  # of those, the first ones told to the cache as MTP KV whole
    page_keys: list[tuple[bytes, PageKey]] = field(default_factory=list)  # prefix-cache keys computed so far
    status: Status = Status.WAITING
    arrival: int = field(default_factory=lambda: next(_arrival))
    num_preemptions: int = 0
    finish_reason: FinishReason | None = None
    error: Error | None = None
    prompt_logprobs: list[TokenLogprob | None] = field(default_factory=list)
    num_emitted_tokens: int = 0
    sample_row: SampleRow = field(init=False)  # made once: it reads `token_ids` itself, never a copy

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.request.prompt_token_ids)
            self.num_prompt_tokens = len(self.token_ids)
        self.sample_row = SampleRow(
            self.request.sampling, self.generator, self.token_ids, self.num_prompt_tokens
        )
        if self.request.sampling.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = [None]  # the first token has no context to be scored in

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_prefilling(self) -> bool:
        """More than the one newest token still lacks KV: a prefill (first, chunked, or recompute)."""
        return len(self.token_ids) - self.num_computed_tokens > 1  # asked of every sequence every step

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt log-probs still to be scored (a recompute after preemption skips those it has)."""
        return self.request.sampling.prompt_logprobs and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def image_hashes_in(self, start: int, end: int) -> list[str]:
        """Hashes of images whose placeholder tokens overlap positions [start, end)."""
        return [
            s.image_hash for s in self.request.image_spans if s.offset < end and s.offset + s.length > start
        ]

    def wrote_draft_kv(self, end: int) -> None:
        """The MTP layer wrote the KV of positions `num_draft_kv_tokens` … `end`-1: whole up to `end`
        unless a gap given up lies below them."""
        if self.num_whole_draft_kv_tokens == self.num_draft_kv_tokens:
            self.num_whole_draft_kv_tokens = end
        self.num_draft_kv_tokens = end

    def clamp_draft_kv(self, num_tokens: int) -> None:
        """Its MTP KV counts below `num_tokens` only (a stop inside an accepted run)."""
        self.num_draft_kv_tokens = min(self.num_draft_kv_tokens, num_tokens)
        self.num_whole_draft_kv_tokens = min(self.num_whole_draft_kv_tokens, num_tokens)

"""Fault injection into the REAL allocator and page-table state of a running engine.

Each injection does to the block manager or a sequence's page table what a bug would do (hand a
live page to someone else, re-allocate it while a step reads it, scribble on a page-table entry) and
records (kind, request, page) in `log`. Nothing here sets `tag_mismatch` or any other flag: the
detection must come from the ops' tag checks, through the engine's normal path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from backend.engine.engine import Engine
from backend.engine.forward_batch import ForwardBatch
from backend.engine.sequence import PageRef, Sequence


@dataclass(frozen=True)
class Injection:
    kind: str
    request_id: str
    page_id: int
    phase: str  # "waiting" | "prefill" | "decode": where the victim was when it was hit


@dataclass
class FaultInjector:
    engine: Engine
    log: list[Injection] = field(default_factory=list)

    def seq(self, request_id: str) -> Sequence:
        return self.engine._seqs[request_id]

    def reassign_live_page(self, victim: str, new_owner: str) -> None:
        """The allocator hands the victim's first page (full, read every step) to another running
        request: fresh tag, new holder, the victim's page table untouched."""
        ref = self.seq(victim).page_table[0]
        self._give(ref.page_id, self.seq(new_owner))
        self.log.append(Injection("reassign_live_page", victim, ref.page_id, self.phase(victim)))

    def reallocate_under_reader(self, victim: str, new_owner: str) -> None:
        """Like `reassign_live_page`, but while the victim's step is in flight: after its batch was
        built (tags checked at build time would pass), before the model reads the cache."""
        runner = self.engine.runner
        forward = runner.model.forward

        def forward_with_race(batch: ForwardBatch) -> torch.Tensor:
            runner.model.forward = forward  # once
            ref = self.seq(victim).page_table[0]
            self._give(ref.page_id, self.seq(new_owner))
            runner.apply_tag_updates(self.engine.block_manager.take_tag_updates())
            self.log.append(Injection("reallocate_under_reader", victim, ref.page_id, self.phase(victim)))
            return forward(batch)

        runner.model.forward = forward_with_race

    def corrupt_page_table_entry(self, victim: str, other: str) -> None:
        """Point the victim's second page-table entry at another request's page (keeping the tag
        the victim expects): without the check it would read the other request's KV."""
        v, o = self.seq(victim), self.seq(other)
        stolen = o.page_table[0].page_id
        v.page_table[1] = PageRef(stolen, v.page_table[1].tag)
        self.log.append(Injection("corrupt_page_table_entry", victim, stolen, self.phase(victim)))

    def corrupt_expected_tag(self, victim: str) -> None:
        """Flip a bit of the tag the victim expects for its first page."""
        v = self.seq(victim)
        ref = v.page_table[0]
        v.page_table[0] = PageRef(ref.page_id, ref.tag ^ (1 << 40))
        self.log.append(Injection("corrupt_expected_tag", victim, ref.page_id, self.phase(victim)))

    def abort(self, victim: str) -> None:
        """The client goes away (the serving layer calls `Engine.abort`)."""
        self.log.append(Injection("abort", victim, -1, self.phase(victim)))
        self.engine.abort(victim)

    def phase(self, request_id: str) -> str:
        seq = self.seq(request_id)
        if not seq.page_table:
            return "waiting"
        return "prefill" if seq.num_computed_tokens < seq.num_prompt_tokens else "decode"

    def _give(self, page_id: int, owner: Sequence) -> None:
        bm = self.engine.block_manager
        if bm.prefix_cache is not None:
            bm.prefix_cache.forget(page_id)
        tag = bm.assign_new_tag(page_id)
        bm.refcounts[page_id] = 1
        bm._ledger[owner.request_id].append(PageRef(page_id, tag))
        owner.page_table.append(PageRef(page_id, tag))


Inject = Callable[[FaultInjector], None]

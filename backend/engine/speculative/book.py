"""The drafts each sequence carries from one speculative step to the next, and their pages.

A step proposes up to k drafts per drafting sequence (backend/engine/speculative/propose.py); the
book keeps them, under the number of tokens the sequence had then, until the next step verifies
them (a prefix of them: exact whatever k was then). Drafts no longer for a sequence's newest token
are never handed out.

Pages: before the step a drafting sequence gets pages for every position the step may write (the
verify rows and the chained drafts). It keeps those past its accepted tokens while it drafts, under
their tags (its spare pages, `BlockManager.reserve_tokens`): the next step needs them again, and a
page given back and reserved anew would carry a new tag and a tag update into that step. It gives
them back when a step does not draft it (`release_spares`), when it finishes or is preempted, or
when the pool runs short. KV written at rejected positions is never read: a position's KV is always
rewritten (verify for the target, propose for the MTP layer) before any query can see it.
The prefix cache only takes pages below `num_computed_tokens`, which counts accepted tokens only.

MTP KV: a step without drafts runs no MTP layer (it is a plain step, exactly what speculation off
runs), so the positions it computes get none; each sequence's `num_draft_kv_tokens` says up to where
its MTP KV is whole. A speculative step runs the MTP layer over every chunk of a sequence that can
ever draft and whose MTP KV is whole up to the chunk (drafting or not: a mid-prompt chunk, a plain
row). A drafting sequence behind (its gap: positions computed by plain steps) catches up before its
first draft: its verify chunk starts at the gap, so the target recomputes the gap's hidden states
(its rows write no target KV: they read what the plain steps wrote, `plan.plan_target`) and depth
0 runs the MTP layer over them and the accepted positions in one prefill-shaped forward. The gap's rows count in the step's token budget; a gap that
does not fit waits for a later step, one that can never fit (`MAX_GAP_SHARE`) is given up: its MTP KV
stays zeros (`num_whole_draft_kv_tokens` at the gap's start, `has_hole`) and the draft reads them
(fewer drafts accepted, never a wrong token; such a sequence's verifies stay out of the acceptance
every sequence's draft length is chosen by). Prompts do not leave such gaps where drafting may run: a
step at such a load that drafts nothing runs the MTP layer over its prompt chunks (decoder.py
`fills_draft_kv`); prefix-cache hits on pages without MTP KV and sequences that ran plain steps above
the draft cap still can. The scheduler keeps each decode's pending drafts' rows out of the prefill
budget (`num_pending_rows`, at most half of it), so a prefill backlog does not crowd every verify out. A prefix-cache hit trusts the MTP KV of its hit pages only as far as the cache holds
it whole, and catches up the rest (backend/engine/block_manager.py, the module doc).
"""

from __future__ import annotations

from backend.engine.block_manager import BlockManager
from backend.engine.scheduler import ScheduledSeq, SchedulerOutput
from backend.engine.sequence import Sequence

MAX_GAP_SHARE = 2  # a gap over max_num_batched_tokens / this is not caught up (see the docstring)


class DraftBook:
    """Which scheduled sequences can draft, their draft pages reserved and given back, and the
    drafts proposed for each sequence's next step."""

    def __init__(
        self, block_manager: BlockManager, *, max_num_batched_tokens: int, can_match_stops: bool
    ) -> None:
        """`can_match_stops`: the engine matches stop strings itself, token by token (it was given a
        detokenizer); otherwise a request with stop strings does not draft, since the serving layer
        could only cut its text, not the tokens and usage, inside a step's accepted run."""
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.can_match_stops = can_match_stops
        # request id -> (its number of tokens when they were proposed, the drafts)
        self.proposed: dict[str, tuple[int, list[int]]] = {}
        # the live requests that may never draft (`add`): none, and a step of decodes alone can
        # draft every sequence, none asked (`can_draft`)
        self.never_drafting_ids: set[str] = set()

    def drafts_for(self, seq: Sequence) -> list[int]:
        """The drafts proposed for `seq`'s newest token, if they are still for it."""
        entry = self.proposed.get(seq.request_id)
        if entry is None or entry[0] != seq.num_tokens:
            return []
        return entry[1]

    def keep(self, seq: Sequence, num_tokens: int, drafts: list[int]) -> None:
        """`drafts` proposed for `seq` once it has `num_tokens` tokens."""
        self.proposed[seq.request_id] = (num_tokens, drafts)

    def forget(self, request_id: str) -> None:
        self.proposed.pop(request_id, None)

    def add(self, seq: Sequence) -> None:
        """`seq` was queued: noted if it may never draft (`can_ever_draft`, fixed for its life)."""
        if not self.can_ever_draft(seq):
            self.never_drafting_ids.add(seq.request_id)

    def finish(self, request_id: str) -> None:
        """The request ended: nothing of it is kept."""
        self.proposed.pop(request_id, None)
        self.never_drafting_ids.discard(request_id)

    def can_draft(self, out: SchedulerOutput) -> list[bool]:
        """Per scheduled sequence, whether it may draft this step at all: in a step of decodes alone
        (each one sampled) with no live request that may never draft, every one, none asked."""
        if out.is_decodes_only and not self.never_drafting_ids:
            return [True] * out.num_decodes
        return [s.needs_sample and self.can_ever_draft(s.seq) for s in out.scheduled]
        # a mid-prompt chunk samples nothing and proposes nothing (its MTP KV is written all the same)

    def can_ever_draft(self, seq: Sequence) -> bool:
        """`seq` may draft on some step (its MTP KV is worth keeping): a grammar masks each
        position by the accepted text (not drafted)."""
        return seq.constraint is None and not (seq.request.sampling.stop and not self.can_match_stops)

    @staticmethod
    def has_hole(seq: Sequence) -> bool:
        """A gap of `seq`'s was given up (`gap`): its drafts read zeros there."""
        return seq.num_whole_draft_kv_tokens < seq.num_draft_kv_tokens

    def num_pending(self, seq: Sequence) -> int:
        """The verify rows `seq`'s drafts would add to its next decode."""
        entry = self.proposed.get(seq.request_id)
        return len(entry[1]) if entry is not None and entry[0] == seq.num_tokens else 0

    def num_pending_rows(self, decodes: list[ScheduledSeq]) -> int:
        """The verify rows the drafts of the step's `decodes` would add (the scheduler keeps them out
        of the prefill budget). Drafts for a token a sequence has moved past (a plain step ran it:
        its tokens only grow) are dropped as they are met, so from a load's second plain step on
        the book is empty and no sequence is asked."""
        proposed = self.proposed
        if not proposed:
            return 0
        num_rows = 0
        for s in decodes:
            seq = s.seq
            entry = proposed.get(seq.request_id)
            if entry is None:
                continue
            if entry[0] == seq.num_tokens:
                num_rows += len(entry[1])
            elif entry[0] < seq.num_tokens:
                del proposed[seq.request_id]
        return num_rows

    def has_chunk_to_fill(self, out: SchedulerOutput, *, must: bool = False) -> bool:
        """The step holds a prompt chunk of a sequence that may draft later and whose MTP KV is whole
        up to it: the MTP layer can write the chunk's MTP KV in this step (decoder.py
        `fills_draft_kv`). `must`: of a prompt too long to catch up later with room to spare (over
        a quarter of a step's budget: a gap over half of it is given up, `gap`), whose MTP KV is
        written now or never whole."""
        if out.is_decodes_only:  # a decode's chunk is its newest token
            return False
        longest = self.max_num_batched_tokens // (2 * MAX_GAP_SHARE) if must else 0
        for s in out.scheduled:
            seq = s.seq
            if (
                seq.num_uncomputed_tokens > 1
                and seq.num_draft_kv_tokens == seq.num_computed_tokens
                and seq.num_prompt_tokens > longest
                and self.can_ever_draft(seq)
            ):
                return True
        return False

    def gap(self, seq: Sequence) -> int:
        """The positions before `seq`'s next chunk whose MTP KV a plain step left unwritten, to catch
        up before it drafts; a gap too long to ever fit a step is given up (left as zeros, its MTP
        KV no longer whole past the gap's start: `num_whole_draft_kv_tokens` stays, `has_hole`): 0."""
        gap = seq.num_computed_tokens - seq.num_draft_kv_tokens
        if gap > self.max_num_batched_tokens // MAX_GAP_SHARE:
            seq.num_draft_kv_tokens, gap = seq.num_computed_tokens, 0
        return gap

    def reserve(self, out: SchedulerOutput, can_draft: list[bool], k: int) -> list[bool]:
        """Which scheduled sequences draft k this step: those that can, whose verify rows (drafts
        and MTP KV gap) fit the step's token budget and whose draft pages fit the pool (now reserved)."""
        flags = [False] * len(out.scheduled)
        budget = self.max_num_batched_tokens - out.num_tokens  # the verify rows count
        for b, s in enumerate(out.scheduled):
            seq = s.seq
            if not can_draft[b]:
                continue
            num_drafts = len(self.drafts_for(seq)[:k]) if seq.num_uncomputed_tokens == 1 else 0
            num_rows = num_drafts + self.gap(seq)  # its catch-up rows too
            if num_rows > budget:
                continue
            # verify rows reach n-1+k; chained drafts after up to k+1 accepted reach n+2k-2
            window = seq.num_prompt_tokens + seq.request.sampling.max_tokens
            flags[b] = self.block_manager.reserve_tokens(seq, min(seq.num_tokens + 2 * k - 1, window))
            budget -= num_rows if flags[b] else 0
        return flags

    def release_spares(self, out: SchedulerOutput, is_drafting: list[bool]) -> None:
        """A sequence that does not draft this step gives its draft pages back."""
        spares = self.block_manager.spare_holders
        if spares:
            keep = {s.seq.request_id for s, d in zip(out.scheduled, is_drafting, strict=True) if d}
            for seq in [seq for rid, seq in spares.items() if rid not in keep]:
                self.block_manager.drop_spare_pages(seq)

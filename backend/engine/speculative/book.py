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
"""

from __future__ import annotations

from backend.engine.block_manager import BlockManager
from backend.engine.scheduler import SchedulerOutput
from backend.engine.sequence import Sequence


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

    def can_draft(self, out: SchedulerOutput) -> list[bool]:
        """Per scheduled sequence, whether it may draft this step at all."""
        return [
            s.needs_sample
            and s.seq.constraint is None
            and not (s.seq.request.sampling.stop and not self.can_match_stops)
            for s in out.scheduled
        ]  # a grammar masks each position by the accepted text (not drafted); a mid-prompt chunk
        # samples nothing and proposes nothing (its MTP KV is filled when its prompt ends)

    def reserve(self, out: SchedulerOutput, can_draft: list[bool], k: int) -> list[bool]:
        """Which scheduled sequences draft k this step: those that can, whose verify rows fit the
        step's token budget and whose draft pages fit the pool (now reserved)."""
        flags = [False] * len(out.scheduled)
        budget = self.max_num_batched_tokens - out.num_tokens  # the verify rows count
        for b, s in enumerate(out.scheduled):
            seq = s.seq
            if not can_draft[b]:
                continue
            num_drafts = len(self.drafts_for(seq)[:k]) if seq.num_uncomputed_tokens == 1 else 0
            if num_drafts > budget:
                continue
            # verify rows reach n-1+k; chained drafts after up to k+1 accepted reach n+2k-2
            window = seq.num_prompt_tokens + seq.request.sampling.max_tokens
            flags[b] = self.block_manager.reserve_tokens(seq, min(seq.num_tokens + 2 * k - 1, window))
            budget -= num_drafts if flags[b] else 0
        return flags

    def release_spares(self, out: SchedulerOutput, is_drafting: list[bool]) -> None:
        """A sequence that does not draft this step gives its draft pages back."""
        spares = self.block_manager.spare_holders
        if spares:
            keep = {s.seq.request_id for s, d in zip(out.scheduled, is_drafting, strict=True) if d}
            for seq in [seq for rid, seq in spares.items() if rid not in keep]:
                self.block_manager.drop_spare_pages(seq)

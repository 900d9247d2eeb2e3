"""Continuous batching: which sequences run this step, and how many of their tokens.

(DESIGN.md §2 step 5.) A step spends at most `max_num_batched_tokens`: first one token for every
running decode (oldest first; decodes never starve), then the next chunk of every running prefill,
then new requests from the queue while the budget, `max_num_seqs` and the page pool allow. A
request is admitted only when pages for all of its tokens are available (prefix-cache hits count);
when a decode needs a page and none is left, the newest running request is preempted: its pages are
released and it is recomputed later from its tokens. Requests that can never run are refused when
they arrive, not queued forever.

Tenants share a replica: while another tenant under its share waits, no tenant (a prefix-cache
salt) may hold more than `tenant_share` of the page pool or of `max_num_seqs`. Its requests past
the share wait while others are admitted (while another tenant's first waiting request would
start within that tenant's share: a request larger than any share does not wait for another such
one), and when the waiting tenant cannot start for lack of pages or sequence slots, the tenant over
its share gives back its newest sequences (preempted, recomputed later).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

from backend.engine.block_manager import BlockManager
from backend.engine.engine_config import EngineConfig
from backend.engine.sequence import Sequence, Status
from backend.errors import Busy, ContextWindowExceeded, InvalidRequest


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int

    @property
    def needs_sample(self) -> bool:
        """This chunk reaches the newest token, so its last row's logits give the next token."""
        return self.num_new_tokens == self.seq.num_uncomputed_tokens


@dataclass(slots=True)
class SchedulerOutput:
    step: int
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # the first `num_decodes` of `scheduled` are decodes: one token each, the newest (so sampled)
    num_decodes: int = 0

    @property
    def is_decodes_only(self) -> bool:
        """Every scheduled chunk is a decode: the sums below need no pass over the sequences."""
        return self.num_decodes == len(self.scheduled)

    @property
    def num_tokens(self) -> int:
        if self.is_decodes_only:
            return self.num_decodes
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_samples(self) -> int:
        """Chunks that reach their sequence's newest token (`ScheduledSeq.needs_sample`)."""
        if self.is_decodes_only:
            return self.num_decodes
        return sum([s.needs_sample for s in self.scheduled])


class Scheduler:
    def __init__(
        self, config: EngineConfig, block_manager: BlockManager, *, context_window: int, vocab_size: int
    ) -> None:
        self.config = config
        self.block_manager = block_manager
        self.context_window = config.context_window or context_window
        self.vocab_size = vocab_size
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self._next_step = 0
        # speculative decoding: the verify rows a decode's pending drafts add, kept out of the prefill
        # budget (backend/engine/speculative/book.py `num_pending_rows`, asked once a step with the
        # decodes), at most half of what the decodes leave: else a prefill backlog fills every step
        # and no drafting sequence ever verifies, or (drafts kept whole) drafting decodes take every
        # row and a new prompt waits for them to end
        self.draft_rows: Callable[[list[ScheduledSeq]], int] | None = None

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        """Queue `seq`, or raise the error that says why it can never (or not now) run."""
        self.validate(seq)
        at = len(self.waiting)  # behind every queued request of the same or a more urgent priority
        while at > 0 and self.waiting[at - 1].request.priority > seq.request.priority:
            at -= 1
        if seq.request.reject_if_busy and (at > 0 or not self._can_start_now(seq)):
            raise Busy("The server is busy and the request asked to be rejected rather than queued.")
        self.waiting.insert(at, seq)

    def validate(self, seq: Sequence) -> None:
        request = seq.request
        num_prompt = len(request.prompt_token_ids)
        max_tokens = request.sampling.max_tokens
        if num_prompt == 0:
            raise InvalidRequest("The prompt is empty: at least one input token is needed.")
        if max_tokens < 1:
            raise InvalidRequest(f"max_tokens must be at least 1, got {max_tokens}.")
        bad = [t for t in request.prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"Token id {bad[0]} is outside the vocabulary (size {self.vocab_size}).")
        for span in request.image_spans:
            if span.offset < 0 or span.length < 1 or span.offset + span.length > num_prompt:
                raise InvalidRequest(f"Image span [{span.offset}, +{span.length}) is outside the prompt.")
        # the replica's window is the model's or its page pool's, whichever is smaller: what its card's
        # `max_request_tokens` and so the catalog's `context_window` advertise
        pool_tokens = self.block_manager.num_pages * self.block_manager.page_size
        if num_prompt + max_tokens > min(self.context_window, pool_tokens):
            raise ContextWindowExceeded(num_prompt + max_tokens, min(self.context_window, pool_tokens))

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(step=self._next_step)
        self._next_step += 1
        budget = self.config.max_num_batched_tokens
        shares = None
        if self.config.tenant_share < 1.0:
            if self.waiting:
                self._reclaim_shares(out)
            shares = _Shares.of(self)
        # tenants over their share decode last: when pages run out, theirs are preempted (a stable
        # sort: with every tenant over its share or none, the order as it was)
        if shares is not None and shares.is_split():
            running = sorted(self.running, key=lambda s: shares.is_over(_tenant(s)))
        else:
            running = list(self.running)
        # decode: one token each, oldest first; preempt the newest when a page is missing
        prefilling = []
        reserve = self.block_manager.reserve_next_slot
        for seq in running:
            if seq.status is not Status.RUNNING:
                continue
            if seq.is_prefilling:  # its chunk comes after every decode
                prefilling.append(seq)
                continue
            if not reserve(seq) and not self._preempt_until_reserved(seq, out):
                continue
            out.scheduled.append(ScheduledSeq(seq, 1))
            budget -= 1
        out.num_decodes = len(out.scheduled)
        num_draft_rows = self.draft_rows(out.scheduled) if self.draft_rows is not None else 0
        if num_draft_rows:
            budget -= min(num_draft_rows, max(budget, 0) // 2)
        # prefill: the next chunk of requests already running (in order), then newly admitted ones
        for seq in prefilling:
            if budget <= 0:
                break
            if seq.status is Status.RUNNING:  # not preempted by a decode above
                n = min(seq.num_uncomputed_tokens, budget)
                out.scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        # admit: not in a step that had to preempt (the pool is short; recompute would thrash);
        # a tenant past its share waits while another tenant's first waiting request would start
        # within its share (`_Shares.must_wait`). Admitting runs only in a step that preempted
        # nothing, so the running sequences are those `shares` counted (a sequence's tokens do not
        # change while it is scheduled)
        admitting = shares
        at = 0
        while (
            at < len(self.waiting)
            and not out.preempted
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            seq = self.waiting[at]
            if admitting is not None and admitting.must_wait(seq):
                at += 1
                continue
            if not self.block_manager.admit(seq):
                break
            del self.waiting[at]
            if admitting is not None:
                admitting.add(seq)
            seq.status = Status.RUNNING
            if seq.num_preemptions == 0:
                seq.num_cached_tokens = seq.num_computed_tokens
            self.running.append(seq)
            n = min(seq.num_uncomputed_tokens, budget)
            out.scheduled.append(ScheduledSeq(seq, n))
            budget -= n
        self.block_manager.touch_sequences([s.seq for s in out.scheduled], out.step)
        return out

    def finish(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and give back its pages (finish, abort, integrity abort)."""
        self.block_manager.release(seq)
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.FINISHED

    # ---- internals -----------------------------------------------------------------------------
    def _preempt_until_reserved(self, seq: Sequence, out: SchedulerOutput) -> bool:
        """Preempt the newest unscheduled requests until `seq` gets its next page (False: `seq`
        itself was the newest, and is preempted); those of a tenant over its share go first, so
        a tenant growing past its share cannot push another tenant's requests out."""
        while not self.block_manager.reserve_next_slot(seq):
            scheduled = {id(s.seq) for s in out.scheduled}
            victims = [s for s in self.running if id(s) not in scheduled]
            if self.config.tenant_share < 1.0:
                shares = _Shares.of(self)
                victims = [s for s in victims if shares.is_over(_tenant(s))] or victims
            victim = max(victims, key=lambda s: s.arrival)
            self._preempt(victim, out)
            if victim is seq:
                return False
        return True

    def _reclaim_shares(self, out: SchedulerOutput) -> None:
        """The first waiting request of a tenant under its share cannot start (no pages, no slot):
        preempt the newest sequences of every other tenant over its share, down to its share (the
        waiting request is admitted in a later step, once the pages are out of quarantine)."""
        shares = _Shares.of(self)
        blocked = next((s for s in self.waiting if not shares.is_over(_tenant(s))), None)
        if blocked is None:
            return
        if len(self.running) < self.config.max_num_seqs and self.block_manager.can_admit(blocked):
            return
        while True:
            over = [s for s in self.running if _tenant(s) != _tenant(blocked) and shares.is_over(_tenant(s))]
            if not over:
                return
            victim = max(over, key=lambda s: s.arrival)
            shares.remove(victim)
            self._preempt(victim, out)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.block_manager.release(seq)
        self.running.remove(seq)
        seq.status = Status.WAITING
        seq.num_computed_tokens = seq.num_draft_kv_tokens = seq.num_whole_draft_kv_tokens = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        out.preempted.append(seq)

    def _can_start_now(self, seq: Sequence) -> bool:
        """Whether `seq` would get pages and a share of the next step's token budget."""
        num_committed = sum(
            min(s.num_uncomputed_tokens, self.config.max_num_batched_tokens) for s in self.running
        )
        return (
            len(self.running) < self.config.max_num_seqs
            and num_committed < self.config.max_num_batched_tokens
            and self.block_manager.can_admit(seq)
        )


def _tenant(seq: Sequence) -> str:
    return seq.request.tenant_salt


@dataclass(slots=True)
class _Shares:
    """Pages and sequences each tenant holds (pages counted with the decode step's next one), and
    the caps of `tenant_share`."""

    max_pages: int
    max_seqs: int
    num_pages: Counter[str]
    num_seqs: Counter[str]
    heads: dict[str, Sequence]  # each waiting tenant's first waiting request
    queue: deque[Sequence]  # the scheduler's waiting queue (a tenant's next head)
    page_size: int

    @classmethod
    def of(cls, scheduler: Scheduler) -> _Shares:
        share = scheduler.config.tenant_share
        num_pages: Counter[str] = Counter()
        num_seqs: Counter[str] = Counter()
        page_size = scheduler.block_manager.page_size
        # pages held, or about to be (a decode's next token may need one); not a drafting sequence's
        # spare pages, which the pool takes back before anyone waits for them (BlockManager)
        for seq in scheduler.running:  # one pass, no calls a sequence: at c = 64 this ran every step
            tenant = seq.request.tenant_salt  # `_tenant`
            num_pages[tenant] += -(-len(seq.token_ids) // page_size)  # `num_tokens`
            num_seqs[tenant] += 1
        heads: dict[str, Sequence] = {}
        for seq in scheduler.waiting:
            heads.setdefault(_tenant(seq), seq)
        return cls(
            max_pages=max(1, int(share * scheduler.block_manager.num_pages)),
            max_seqs=max(1, int(share * scheduler.config.max_num_seqs)),
            num_pages=num_pages,
            num_seqs=num_seqs,
            heads=heads,
            queue=scheduler.waiting,
            page_size=page_size,
        )

    def is_split(self) -> bool:
        """Of the tenants running, some are over their share (`is_over`) and some are not: only then
        does ordering the decodes by it change their order (a stable sort of equal keys keeps it;
        one tenant alone past its share, as a single-tenant load is, gives all-equal keys)."""
        over = [self.is_over(t) for t, n in self.num_seqs.items() if n]
        return any(over) and not all(over)

    def is_over(self, tenant: str) -> bool:
        """Holds more than its share (strictly: a tenant at its share is left alone)."""
        return self.num_pages[tenant] > self.max_pages or self.num_seqs[tenant] > self.max_seqs

    def fits(self, seq: Sequence) -> bool:
        """Admitting `seq` keeps its tenant within its share."""
        tenant = _tenant(seq)
        return (
            self.num_seqs[tenant] + 1 <= self.max_seqs
            and self.num_pages[tenant] + -(-seq.num_tokens // self.page_size) <= self.max_pages
        )

    def must_wait(self, seq: Sequence) -> bool:
        """Admitting `seq` would take its tenant past its share while another tenant waits whose
        first waiting request would start within its own. (Any other waiting tenant, as before
        2026-12-07: two tenants each asking more than their share, nothing running, each waited
        for the other for good.)"""
        if self.fits(seq):
            return False
        tenant = _tenant(seq)
        return any(t != tenant and self.fits(head) for t, head in self.heads.items())

    def add(self, seq: Sequence) -> None:
        """`seq`, just taken off the waiting queue, starts."""
        tenant = _tenant(seq)
        self.num_pages[tenant] += seq.page_table.length
        self.num_seqs[tenant] += 1
        if self.heads.get(tenant) is seq:
            head = next((s for s in self.queue if _tenant(s) == tenant), None)
            if head is None:
                del self.heads[tenant]
            else:
                self.heads[tenant] = head

    def remove(self, seq: Sequence) -> None:
        """`seq` is preempted: it goes back to the front of the waiting queue."""
        tenant = _tenant(seq)
        self.num_pages[tenant] -= -(-seq.num_tokens // self.page_size)  # as `of` counted it
        self.num_seqs[tenant] -= 1
        self.heads[tenant] = seq

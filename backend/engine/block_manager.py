"""Physical KV pages: who holds which, the tag each carries, and when a freed page may be reused.

(DESIGN.md §2 step 6.) Tags come from one global counter that only grows: every allocation of a
page gives it a new tag, so a reader holding (page, old tag) can always tell that the page changed
hands. Two records say who holds a page: each sequence's page table (what attention reads through,
checked against the tags) and this manager's ledger (what gets freed). Freeing goes by the ledger
and only drops a reference whose tag is still the page's tag, so a request that lost its page can
never free it from under the new owner. A page whose last reference goes is quarantined until the
step that last touched it has completed (reliability-anchors §1.3: a late write from that step
must not land in a page already given to someone else). A page is touched by every step that
schedules a sequence holding it, so the step a sequence last ran in (`touch_sequences`, O(1) per
sequence rather than per page) is folded into each of its pages when it lets them go: a page's last
step is the latest over every holder it had. (The scheduler gives a sequence pages only in a step
that schedules it, admission or decode, so no page a holder lets go is newer than its last step.)

Speculative decoding reserves pages past a sequence's tokens for its drafts (`reserve_tokens`). A
sequence that keeps drafting keeps them from step to step, under their tags (a page dropped after
each step and reserved again would come back with a new tag, and the step would carry its update):
they are its spare pages, dropped when it stops drafting (`drop_spare_pages`), finishes or is
preempted (`release`), or when the pool runs short: a decode's next page or an admission takes
every sequence's spare pages before it fails (and before the scheduler preempts anyone).

MTP KV (speculative decoding's draft layer, backend/engine/speculative/book.py): a page computed by
plain steps is published with none (zeros, or a rejected draft's). The cache holds which pages'
MTP KV is whole; a holder tells it (`publish_full_pages`) once its `num_whole_draft_kv_tokens` covers
a page, whether it computed the page or caught it up over a hit. A hit trusts the MTP KV of the hits
whose MTP KV is whole, from the first; past them a drafting sequence catches up as after plain steps
(its depth-0 rows write the MTP KV of shared pages: the same tokens' MTP KV, equal up to a batch
shape's last bits, read only by drafts, so acceptance alone can change by it, never a token).
A page's last position is the one exception: its MTP KV reads the token after the page, which the
page's key does not hold, so a hit whose next page differs reads that one entry as its writer left it.

The manager holds no tensors: the sequences' page tables are rows of its host `PageTables`
(`backend.engine.page_table`), which the model runner gathers, and the runner copies `take_tag_updates()`
into `KVCache.page_tags`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from backend.engine.page_table import PageRef, PageTables
from backend.engine.prefix_cache import PageKey, PrefixCache
from backend.engine.sequence import Sequence


@dataclass(slots=True)
class BlockStats:
    num_allocations: int = 0
    num_stale_frees: int = 0  # frees skipped because the page had been re-tagged since


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, *, enable_prefix_cache: bool = True) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.tags = [0] * num_pages  # 0: never allocated; real tags start at 1
        self.refcounts = [0] * num_pages
        self.stats = BlockStats()
        self.prefix_cache = PrefixCache(page_size) if enable_prefix_cache else None
        self.completed_step = -1
        self._next_tag = 1
        self._free: deque[int] = deque(range(num_pages))
        self._quarantine: dict[int, None] = {}  # ordered set: a page is listed once however often dropped
        self._last_step = [-1] * num_pages
        self._ledger: dict[str, list[PageRef]] = {}
        self._seq_steps: dict[str, int] = {}  # request id -> last step that scheduled it
        self.page_tables = PageTables()
        self._tag_updates: dict[int, int] = {}
        self._spares: dict[str, Sequence] = {}  # request id -> a sequence holding pages past its tokens

    # ---- counts --------------------------------------------------------------------------------
    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_quarantined_pages(self) -> int:
        return len(self._quarantine)

    @property
    def num_available_pages(self) -> int:
        """Pages an allocation could get now: free, or cached and unreferenced (evictable)."""
        evictable = self.prefix_cache.num_evictable if self.prefix_cache else 0
        return len(self._free) + evictable

    @property
    def num_spare_pages(self) -> int:
        """Pages held past their sequences' tokens (draft pages kept between steps)."""
        return sum(
            max(0, len(s.page_table) - self.num_pages_for(s.num_tokens)) for s in self._spares.values()
        )

    def num_pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    # ---- sequences -------------------------------------------------------------------------------
    def can_admit(self, seq: Sequence) -> bool:
        """Whether `admit(seq)` would succeed now."""
        return self._plan(seq) is not None

    def admit(self, seq: Sequence) -> bool:
        """Give `seq` pages for all of its tokens, reusing cached full pages of its prefix.

        Returns False, changing nothing (but perhaps taking the spare pages), when the pool cannot
        hold it now.
        """
        assert not seq.page_table, "admit() on a sequence that still holds pages"
        plan = self._plan(seq)
        if plan is None:
            return False
        if plan[2] > self.num_available_pages - sum(1 for p in plan[1] if self.refcounts[p] == 0):
            self.drop_all_spare_pages()  # it fits only with them (`_plan` counts them)
            plan = self._plan(seq)
            if plan is None:  # they went to quarantine: their holders' last step is still running
                return False
        keys, hits, num_new = plan
        self.page_tables.attach(seq.page_table)
        if self.prefix_cache is not None and not seq.wants_prompt_logprobs:
            self.prefix_cache.record_lookup(len(hits), missed=len(hits) < len(keys))
        for page_id in hits:
            self._share(seq, page_id)
        for _ in range(num_new):
            self._allocate(seq)
        seq.page_hashes = [digest for digest, _ in keys[: len(hits)]]
        seq.num_computed_tokens = len(hits) * self.page_size
        # MTP KV: trusted over the hits whose MTP KV is whole; past them a drafting sequence catches up
        num_whole = self._num_whole_draft_kv_pages(hits)
        seq.num_draft_kv_tokens = seq.num_whole_draft_kv_tokens = num_whole * self.page_size
        seq.num_whole_draft_kv_pages = num_whole
        return True

    def _plan(self, seq: Sequence) -> tuple[list[tuple[bytes, PageKey]], list[int], int] | None:
        """(full-page keys, cached pages to share, pages to allocate), or None if they don't fit."""
        keys = self._full_page_keys(seq, seq.num_tokens) if self.prefix_cache is not None else []
        hits: list[int] = []
        if self.prefix_cache is not None and not seq.wants_prompt_logprobs:
            max_hits = (seq.num_tokens - 1) // self.page_size  # always compute >= 1 token
            for digest, key in keys[:max_hits]:
                page_id = self.prefix_cache.peek(digest, key, self.tags)
                if page_id is None:
                    break
                hits.append(page_id)
        num_new = self.num_pages_for(seq.num_tokens) - len(hits)
        num_hits_evictable = sum(1 for p in hits if self.refcounts[p] == 0)
        if num_new > self.num_available_pages + self.num_spare_pages - num_hits_evictable:
            return None
        return keys, hits, num_new

    def reserve_next_slot(self, seq: Sequence) -> bool:
        """Make sure the page for the token whose KV is written next exists (decode)."""
        if seq.page_table.length * self.page_size > seq.num_computed_tokens:
            return True
        if self.num_available_pages == 0:
            self.drop_all_spare_pages()
            if self.num_available_pages == 0:
                return False
        self._allocate(seq)
        return True

    def reserve_tokens(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` pages for its first `num_tokens` tokens (speculative decoding's draft and
        verify positions); False, changing nothing, when the pool cannot. Pages past its tokens are
        its spare pages: kept, under their tags, until `drop_spare_pages` or `release`."""
        num_new = self.num_pages_for(num_tokens) - seq.page_table.length
        if num_new > self.num_available_pages:
            return False
        for _ in range(num_new):
            self._allocate(seq)
        if seq.page_table.length > self.num_pages_for(seq.num_tokens):
            self._spares[seq.request_id] = seq
        return True

    @property
    def spare_holders(self) -> dict[str, Sequence]:
        """Request id -> sequence, for every sequence that may hold spare pages (read only)."""
        return self._spares

    def drop_spare_pages(self, seq: Sequence) -> None:
        """Drop the pages of `seq` past its tokens (it stops drafting), by the ledger."""
        if self._spares.pop(seq.request_id, None) is not None:
            self.truncate(seq, self.num_pages_for(seq.num_tokens))

    def drop_all_spare_pages(self) -> None:
        """Every sequence's spare pages back to the pool (it is short of pages)."""
        for seq in list(self._spares.values()):
            self.drop_spare_pages(seq)

    def truncate(self, seq: Sequence, num_pages: int) -> None:
        """Drop the pages of `seq` past its first `num_pages` (spare draft pages), by the ledger,
        as `release` drops them: quarantined until the step that last touched them completes."""
        ledger = self._ledger.get(seq.request_id, [])
        if len(ledger) <= num_pages:
            return
        step = self._seq_steps.get(seq.request_id, -1)
        for ref in ledger[num_pages:]:
            self._drop(ref, step)
        del ledger[num_pages:]
        seq.page_table.truncate(num_pages)

    def release(self, seq: Sequence) -> None:
        """Drop every page `seq` holds (finish, abort, preemption), by the ledger."""
        step = self._seq_steps.pop(seq.request_id, -1)
        self._spares.pop(seq.request_id, None)
        for ref in self._ledger.pop(seq.request_id, []):
            self._drop(ref, step)
        self.page_tables.detach(seq.page_table)
        seq.page_hashes, seq.num_whole_draft_kv_pages = [], 0

    def distrust(self, seq: Sequence) -> None:
        """Take every page of `seq` out of the prefix cache: one of them failed the tag check, on
        this rank or another (which cannot say which), so no later request may be given it again.
        Its holders keep it until they let go; then it is free, and its next owner gets a new tag.
        By the ledger, not the page table the check read: a page the table names that `seq` does not
        hold under its tag (the table gone wrong) is another holder's, or cached and held by no one,
        and dropping it from the cache took another tenant's entry and left it in no pool for good."""
        if self.prefix_cache is not None:
            for ref in self._ledger.get(seq.request_id, []):
                if self.tags[ref.page_id] == ref.tag:
                    self.prefix_cache.forget(ref.page_id)

    def publish_full_pages(self, seq: Sequence) -> None:
        """Offer the prefix cache every full page of `seq` whose KV is now computed, and tell it
        which of its pages' MTP KV is now whole (the module doc: MTP KV)."""
        if self.prefix_cache is None:
            return
        num_full = seq.num_computed_tokens // self.page_size
        if num_full > len(seq.page_hashes):
            keys = self._full_page_keys(seq, num_full * self.page_size)
            for i in range(len(seq.page_hashes), num_full):
                digest, key = keys[i]
                ref = seq.page_table[i]
                self.prefix_cache.insert(digest, key, ref.page_id, ref.tag)
                seq.page_hashes.append(digest)
        num_whole = min(len(seq.page_hashes), seq.num_whole_draft_kv_tokens // self.page_size)
        for i in range(seq.num_whole_draft_kv_pages, num_whole):
            self.prefix_cache.mark_draft_kv_whole(seq.page_table[i].page_id)
        seq.num_whole_draft_kv_pages = max(seq.num_whole_draft_kv_pages, num_whole)

    # ---- steps ---------------------------------------------------------------------------------
    def touch(self, page_ids: list[int], step: int) -> None:
        """Record that `step` reads or writes these pages."""
        for p in page_ids:
            self._last_step[p] = step

    def touch_sequences(self, seqs: list[Sequence], step: int) -> None:
        """Record that `step` reads or writes every page these sequences hold (see the module doc)."""
        steps = self._seq_steps
        for seq in seqs:
            steps[seq.request_id] = step

    def complete_step(self, step: int) -> None:
        """`step` has finished on the device: quarantined pages it last touched may be reused."""
        self.completed_step = step
        still: dict[int, None] = {}
        for p in self._quarantine:
            if self.refcounts[p] > 0:  # shared again from the prefix cache while quarantined
                continue
            if self._last_step[p] > step:
                still[p] = None
            elif self.prefix_cache is not None and self.prefix_cache.is_cached(p):
                self.prefix_cache.mark_unreferenced(p)
            else:
                self._free.append(p)
        self._quarantine = still

    def take_tag_updates(self) -> list[tuple[int, int]]:
        """(page, new tag) pairs since the last call, for the runner to write into the cache."""
        updates = list(self._tag_updates.items())
        self._tag_updates.clear()
        return updates

    # ---- internals -----------------------------------------------------------------------------
    def _num_whole_draft_kv_pages(self, hits: list[int]) -> int:
        """How many of the hit pages, from the first, the prefix cache holds as MTP KV whole."""
        cache, n = self.prefix_cache, 0
        while n < len(hits) and cache is not None and cache.is_draft_kv_whole(hits[n]):
            n += 1
        return n

    def _full_page_keys(self, seq: Sequence, num_tokens: int) -> list[tuple[bytes, PageKey]]:
        """Chained keys of the full pages among the first `num_tokens` tokens, extending the ones
        `seq` already has (its tokens only ever grow, so they stay valid)."""
        keys = seq.page_keys
        for i in range(len(keys), num_tokens // self.page_size):
            start, end = i * self.page_size, (i + 1) * self.page_size
            parent = keys[-1][0] if keys else b""
            key = PrefixCache.key(
                seq.request.tenant_salt, parent, seq.token_ids[start:end], seq.image_hashes_in(start, end)
            )
            keys.append((key.digest(), key))
        return keys[: num_tokens // self.page_size]

    def _take_page(self) -> int:
        if self._free:
            page_id = self._free.popleft()
            if self.prefix_cache is not None:
                self.prefix_cache.forget(page_id)
            return page_id
        assert self.prefix_cache is not None, "no page available: callers check num_available_pages"
        evicted = self.prefix_cache.evict_lru()
        assert evicted is not None, "no page available: callers check num_available_pages"
        return evicted

    def assign_new_tag(self, page_id: int) -> int:
        """Give `page_id` a fresh tag from the global counter (every allocation does this)."""
        tag = self._next_tag
        self._next_tag += 1
        self.tags[page_id] = tag
        self._tag_updates[page_id] = tag
        return tag

    def _allocate(self, seq: Sequence) -> None:
        page_id = self._take_page()
        ref = PageRef(page_id, self.assign_new_tag(page_id))
        self.refcounts[page_id] = 1
        self.stats.num_allocations += 1
        seq.page_table.append(ref)
        self._ledger.setdefault(seq.request_id, []).append(PageRef(ref.page_id, ref.tag))

    def _share(self, seq: Sequence, page_id: int) -> None:
        if self.refcounts[page_id] == 0 and self.prefix_cache is not None:
            self.prefix_cache.mark_referenced(page_id)
        self.refcounts[page_id] += 1
        ref = PageRef(page_id, self.tags[page_id])
        seq.page_table.append(ref)
        self._ledger.setdefault(seq.request_id, []).append(PageRef(ref.page_id, ref.tag))

    def _drop(self, ref: PageRef, step: int) -> None:
        """Drop one reference of a holder that last ran in `step`."""
        p = ref.page_id
        if self.tags[p] != ref.tag or self.refcounts[p] == 0:
            self.stats.num_stale_frees += 1
            return
        self._last_step[p] = max(self._last_step[p], step)
        self.refcounts[p] -= 1
        if self.refcounts[p] > 0:
            return
        if self._last_step[p] > self.completed_step:
            self._quarantine[p] = None
        elif self.prefix_cache is not None and self.prefix_cache.is_cached(p):
            self.prefix_cache.mark_unreferenced(p)
        else:
            self._free.append(p)

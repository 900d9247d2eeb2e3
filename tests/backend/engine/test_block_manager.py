"""Block manager: tags never repeat, frees go by the ledger, quarantine holds pages until their step ends."""

from __future__ import annotations

import torch

from backend.engine.block_manager import BlockManager
from backend.engine.sequence import PageRef, Sequence
from tests.backend.engine_helpers import TENANT_A, request


def seq(request_id: str, num_tokens: int, first_token: int = 0) -> Sequence:
    tokens = list(range(first_token, first_token + num_tokens))
    return Sequence(request=request(request_id, tokens), generator=torch.Generator())


def test_every_allocation_gets_a_fresh_tag_and_the_runner_sees_it() -> None:
    bm = BlockManager(num_pages=4, page_size=16, enable_prefix_cache=False)
    a = seq("a", 40)  # 3 pages
    assert bm.admit(a)
    first_tags = [ref.tag for ref in a.page_table]
    assert len(set(first_tags)) == 3 and min(first_tags) >= 1
    assert dict(bm.take_tag_updates()) == {ref.page_id: ref.tag for ref in a.page_table}
    bm.release(a)
    b = seq("b", 64)  # all 4 pages, three of them a's old ones
    assert bm.admit(b)
    reused = {ref.page_id: ref.tag for ref in b.page_table}
    assert all(reused[ref.page_id] > max(first_tags) for ref in a.page_table if ref.page_id in reused)
    assert len({ref.tag for ref in b.page_table} | set(first_tags)) == 7  # no tag ever repeats
    assert bm.num_free_pages == 0


def test_admit_changes_nothing_when_the_pool_cannot_hold_the_sequence() -> None:
    bm = BlockManager(num_pages=3, page_size=16, enable_prefix_cache=False)
    assert not bm.admit(seq("big", 49))  # needs 4 pages
    assert bm.num_free_pages == 3 and bm.stats.num_allocations == 0
    assert bm.admit(seq("fits", 48))


def test_decode_reserves_a_page_only_at_a_page_boundary() -> None:
    bm = BlockManager(num_pages=4, page_size=16, enable_prefix_cache=False)
    s = seq("s", 16)
    assert bm.admit(s) and len(s.page_table) == 1
    s.num_computed_tokens = 15  # the 16th token's KV goes to page 0
    assert bm.reserve_next_slot(s) and len(s.page_table) == 1
    s.num_computed_tokens = 16  # the 17th needs page 1
    assert bm.reserve_next_slot(s) and len(s.page_table) == 2


def test_a_stale_reference_never_frees_the_new_owner_page() -> None:
    bm = BlockManager(num_pages=2, page_size=16, enable_prefix_cache=False)
    a, b = seq("a", 16), seq("b", 16)
    assert bm.admit(a)
    page = a.page_table[0].page_id
    # a bug hands a's live page to b: new tag, b holds it; a's ledger entry is now stale
    tag = bm.assign_new_tag(page)
    bm._ledger["b"] = [PageRef(page, tag)]
    bm.page_tables.attach(b.page_table)
    b.page_table.append(PageRef(page, tag))
    bm.release(a)
    assert bm.refcounts[page] == 1 and bm.stats.num_stale_frees == 1
    bm.release(b)
    assert bm.refcounts[page] == 0 and bm.num_free_pages == 2


def test_freed_page_stays_quarantined_until_its_last_step_completes() -> None:
    bm = BlockManager(num_pages=2, page_size=16, enable_prefix_cache=False)
    a = seq("a", 16)
    assert bm.admit(a)
    page = a.page_table[0].page_id
    bm.touch([page], step=7)  # step 7 is in flight on the device
    bm.complete_step(6)
    bm.release(a)  # e.g. the client went away mid-step
    assert bm.num_quarantined_pages == 1 and bm.num_free_pages == 1
    b = seq("b", 32)
    assert not bm.admit(b)  # the quarantined page is not handed out
    c = seq("c", 16)
    assert bm.admit(c) and c.page_table[0].page_id != page
    bm.complete_step(7)
    assert bm.num_quarantined_pages == 0 and bm.num_free_pages == 1
    d = seq("d", 16)
    assert bm.admit(d) and d.page_table[0].page_id == page


def test_ledger_survives_a_corrupted_page_table() -> None:
    bm = BlockManager(num_pages=3, page_size=16, enable_prefix_cache=False)
    a, b = seq("a", 16), seq("b", 16)
    assert bm.admit(a) and bm.admit(b)
    a.page_table[0] = PageRef(b.page_table[0].page_id, a.page_table[0].tag)  # corrupted entry
    bm.release(a)
    bm.release(b)
    assert bm.num_free_pages == 3 and bm.stats.num_stale_frees == 0
    assert sum(bm.refcounts) == 0


def test_tenant_salt_is_part_of_every_page_key() -> None:
    bm = BlockManager(num_pages=8, page_size=16)
    a = seq("a", 33)
    assert bm.admit(a)
    a.num_computed_tokens = 33
    bm.publish_full_pages(a)
    assert bm.prefix_cache is not None and bm.prefix_cache.num_cached == 2
    assert a.request.tenant_salt == TENANT_A
    keys = bm._full_page_keys(a, 32)
    assert keys[0][1].tenant_salt == TENANT_A and keys[1][1].parent == keys[0][0]


def test_a_shared_cached_page_lives_until_its_last_reader_and_is_retagged_when_evicted() -> None:
    bm = BlockManager(num_pages=3, page_size=16)
    owner = seq("owner", 20)  # page 0 full (published), page 1 partial
    assert bm.admit(owner)
    owner.num_computed_tokens = 20
    bm.publish_full_pages(owner)
    shared = owner.page_table[0]
    reader = seq("reader", 20)  # same tenant, same first 16 tokens: shares page 0
    assert bm.admit(reader) and reader.page_table[0] == shared and reader.num_computed_tokens == 16
    assert bm.refcounts[shared.page_id] == 2
    bm.release(owner)  # one reader left: neither free nor evictable
    assert bm.refcounts[shared.page_id] == 1 and bm.num_available_pages == 1
    assert not bm.admit(seq("big", 40, first_token=50))  # 3 pages: only owner's partial page is free
    bm.release(reader)
    assert bm.refcounts[shared.page_id] == 0 and bm.num_available_pages == 3
    big = seq("big", 40, first_token=50)
    assert bm.admit(big) and big.num_computed_tokens == 0  # other tokens: a miss, so it evicts
    reused = next(ref for ref in big.page_table if ref.page_id == shared.page_id)
    assert reused.tag > shared.tag and bm.prefix_cache is not None and bm.prefix_cache.num_cached == 0
    bm.release(big)
    again = seq("again", 20)  # the evicted content is gone: no stale hit on the retagged page
    assert bm.admit(again) and again.num_computed_tokens == 0


def test_a_cached_page_shared_and_dropped_twice_while_quarantined_is_freed_once() -> None:
    """With steps in flight, a published page can be dropped (quarantined), hit again by the prefix
    cache, and dropped again before its step completes. It must come back exactly once: listed
    twice it would be handed to two sequences at once."""
    bm = BlockManager(num_pages=4, page_size=16)
    owner = seq("owner", 20)
    assert bm.admit(owner)
    owner.num_computed_tokens = 20
    bm.publish_full_pages(owner)
    page = owner.page_table[0].page_id
    bm.touch([page], step=5)  # step 5 still on the device
    bm.release(owner)  # quarantined
    reader = seq("reader", 20)
    assert bm.admit(reader) and reader.page_table[0].page_id == page  # a hit on the quarantined page
    bm.touch([page], step=6)
    bm.release(reader)  # quarantined again, before step 5 or 6 completes
    assert bm.num_quarantined_pages == 1  # listed once
    bm.complete_step(6)
    assert bm.num_quarantined_pages == 0
    taken = []
    for i in range(4):  # every page of the pool, the cached one evicted on the way
        s = seq(f"s{i}", 16, first_token=100 + 16 * i)
        assert bm.admit(s)
        taken.append(s.page_table[0].page_id)
    assert sorted(taken) == [0, 1, 2, 3]  # no page handed out twice
    assert not bm.admit(seq("more", 16, first_token=900))


def test_spare_pages_are_kept_until_dropped_and_taken_when_the_pool_runs_short() -> None:
    """Draft pages past a sequence's tokens stay with it, under their tags, until it drops them or
    is released; a decode's next page or an admission that would not fit otherwise takes them."""
    bm = BlockManager(num_pages=4, page_size=4, enable_prefix_cache=False)
    a, b = seq("a", 3), seq("b", 5)
    assert bm.admit(a) and bm.admit(b)  # 1 + 2 pages
    assert bm.reserve_tokens(a, 8) and len(a.page_table) == 2 and bm.num_free_pages == 0
    spare = a.page_table[1]
    assert bm.num_spare_pages == 1 and set(bm.spare_holders) == {"a"}
    assert bm.reserve_tokens(a, 8) and a.page_table[1] == spare  # a later step: the same page, tag
    assert bm.stats.num_allocations == 4
    bm.drop_spare_pages(a)
    assert len(a.page_table) == 1 and bm.num_free_pages == 1 and not bm.spare_holders
    assert bm.reserve_tokens(a, 8) and bm.tags[a.page_table[1].page_id] > spare.tag  # anew: new tag

    b.token_ids.extend([9, 9, 9])  # b decodes into a third page: only a's spare page is left
    b.num_computed_tokens = 8
    assert bm.reserve_next_slot(b) and len(b.page_table) == 3 and len(a.page_table) == 1
    assert bm.num_spare_pages == 0 and bm.num_free_pages == 0

    bm.release(b)  # 3 pages free; a drafts again, and c needs all 3
    assert bm.reserve_tokens(a, 8) and bm.num_free_pages == 2
    c = seq("c", 12)
    assert bm.can_admit(c) and bm.admit(c) and len(a.page_table) == 1 and len(c.page_table) == 3
    assert not bm.admit(seq("d", 1))  # nothing spare left to take

    assert bm.reserve_tokens(a, 5) is False and len(a.page_table) == 1  # the pool is full
    bm.release(a)
    bm.release(c)
    assert bm.num_free_pages == 4 and not bm.spare_holders and bm.num_spare_pages == 0


def test_a_hit_trusts_the_mtp_kv_of_its_hits_only_as_far_as_it_is_whole() -> None:
    """A page published by plain steps carries no MTP KV: a hit on it starts its MTP KV at the page
    (to catch up), and once a holder's MTP KV covers the page, later hits trust it. A gap given up
    (the cursor moved, nothing written) never makes a page whole."""
    bm = BlockManager(num_pages=12, page_size=16)
    owner = seq("owner", 50)  # 3 full pages
    assert bm.admit(owner)
    owner.num_computed_tokens = 50
    owner.wrote_draft_kv(16)  # a speculative first chunk, then plain steps
    bm.publish_full_pages(owner)
    reader = seq("reader", 50)
    assert bm.admit(reader) and reader.num_computed_tokens == 48
    assert reader.num_draft_kv_tokens == reader.num_whole_draft_kv_tokens == 16
    reader.num_draft_kv_tokens = 48  # its gap given up (backend/engine/speculative/book.py)
    reader.wrote_draft_kv(50)
    bm.publish_full_pages(reader)
    late = seq("late", 50)
    assert bm.admit(late) and late.num_draft_kv_tokens == 16 and reader.num_whole_draft_kv_tokens == 16
    owner.wrote_draft_kv(50)  # the owner catches up over its own published pages
    bm.publish_full_pages(owner)
    assert owner.num_whole_draft_kv_pages == 3
    again = seq("again", 50)
    assert bm.admit(again) and again.num_draft_kv_tokens == again.num_whole_draft_kv_tokens == 48
    assert again.num_whole_draft_kv_pages == 3
    for s in (owner, reader, late, again):
        bm.release(s)
    assert bm.num_available_pages == 12 and owner.num_whole_draft_kv_pages == 0


def test_a_catch_up_over_hit_pages_makes_them_whole_and_eviction_forgets_it() -> None:
    bm = BlockManager(num_pages=4, page_size=16)
    owner = seq("owner", 20)  # plain steps only: page 0 published without MTP KV
    assert bm.admit(owner)
    owner.num_computed_tokens = 20
    bm.publish_full_pages(owner)
    reader = seq("reader", 20)
    assert bm.admit(reader) and reader.num_draft_kv_tokens == 0
    reader.num_computed_tokens = 20
    reader.wrote_draft_kv(20)  # it drafts: its verify caught up the shared page
    bm.publish_full_pages(reader)
    page = owner.page_table[0].page_id
    assert bm.prefix_cache is not None and bm.prefix_cache.is_draft_kv_whole(page)
    bm.release(owner)
    bm.release(reader)
    big = seq("big", 64, first_token=50)  # every page: evicts the cached one
    assert bm.admit(big) and not bm.prefix_cache.is_draft_kv_whole(page)

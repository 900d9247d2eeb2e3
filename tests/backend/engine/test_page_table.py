"""Incremental page tables: the pool's rows, after any sequence of admit / extend / share / scribble /
preempt / free, equal a from-scratch rebuild from each sequence's own pairs; touching sequences
instead of pages quarantines and frees exactly what touching every page did."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from backend.engine.block_manager import BlockManager
from backend.engine.page_table import PAD_PAGE, PAD_TAG, PageRef, PageTable, PageTables
from backend.engine.sequence import Sequence
from tests.backend.engine_helpers import TENANT_A, TENANT_B, request

S = 4  # page size


def test_a_table_reads_and_writes_like_a_list_of_page_refs() -> None:
    pool = PageTables(num_rows=1, width=2)
    a, b = PageTable(), PageTable()
    assert not a and len(a) == 0 and list(a) == []
    pool.attach(a)
    pool.attach(b)  # a second row: the pool doubles its rows
    refs = [PageRef(p, 10 + p) for p in (5, 3, 9, 1, 7)]
    for ref in refs:
        a.append(ref)  # past the width: the pool doubles it, rows keep their entries
    b.append(PageRef(2, 2))
    assert list(a) == refs and a[-1] == refs[-1] and a[1:3] == refs[1:3] and b[0] == PageRef(2, 2)
    a[2] = PageRef(0, 99)
    assert a[2] == PageRef(0, 99) and a.page_id_list() == [5, 3, 0, 1, 7]
    with pytest.raises(IndexError):
        a[5]
    row = a.row
    pool.detach(a)
    assert not a and a.pool is None and pool.num_attached == 1
    assert (pool.page_ids[row] == PAD_PAGE).all() and (pool.tags[row] == PAD_TAG).all()


def test_gather_cuts_each_table_to_the_pages_in_use() -> None:
    pool = PageTables()
    tables = [PageTable() for _ in range(3)]
    for i, t in enumerate(tables):
        pool.attach(t)
        for j in range(i + 2):
            t.append(PageRef(10 * i + j, 100 * i + j))
    rows = np.array([t.row for t in tables])
    ids, tags = pool.gather(rows, np.array([len(t) for t in tables]), np.array([1, 3, 2]))
    assert ids.tolist() == [[0, PAD_PAGE, PAD_PAGE], [10, 11, 12], [20, 21, PAD_PAGE]]
    assert tags.tolist() == [[0, PAD_TAG, PAD_TAG], [100, 101, 102], [200, 201, PAD_TAG]]
    with pytest.raises(AssertionError):
        pool.gather(rows[:1], np.array([2]), np.array([3]))  # more pages than the table holds


def _seq(rid: str, tokens: list[int], tenant: str) -> Sequence:
    return Sequence(request=request(rid, tokens, tenant=tenant), generator=torch.Generator())


def _rebuild(seq: Sequence, num_pages: int, width: int) -> tuple[list[int], list[int]]:
    """The padded row a step used to build from the sequence's pairs, page by page."""
    refs = list(seq.page_table)[:num_pages]
    pad = width - len(refs)
    return [r.page_id for r in refs] + [PAD_PAGE] * pad, [r.tag for r in refs] + [PAD_TAG] * pad


@pytest.mark.parametrize("seed", range(12))
def test_fuzz_incremental_tables_equal_a_rebuild(seed: int) -> None:
    rng = random.Random(seed)
    bm = BlockManager(num_pages=40, page_size=S, enable_prefix_cache=seed % 3 != 0)
    live: list[Sequence] = []
    prompts = [[rng.randrange(50) for _ in range(rng.randrange(1, 30))] for _ in range(6)]  # shared prefixes
    for op in range(400):
        kind = rng.random()
        if kind < 0.3 or not live:  # admit, often a prompt seen before (prefix-cache hits)
            s = _seq(f"s{op}", list(rng.choice(prompts)), rng.choice((TENANT_A, TENANT_B)))
            if bm.admit(s):
                live.append(s)
        elif kind < 0.75:  # decode: KV of every token so far, then a page for the next
            s = rng.choice(live)
            s.num_computed_tokens = s.num_tokens
            bm.publish_full_pages(s)
            s.token_ids.append(rng.randrange(50))
            if not bm.reserve_next_slot(s):
                bm.release(live.pop(live.index(s)))  # preempted
        elif kind < 0.8:  # a bug scribbles on an entry: the table must show it as written
            s = rng.choice(live)
            i = rng.randrange(len(s.page_table))
            s.page_table[i] = PageRef(rng.randrange(40), rng.randrange(1, 1000))
        else:  # finish, abort or preemption
            bm.release(live.pop(rng.randrange(len(live))))
        bm.touch_sequences(live, op)
        bm.complete_step(op)
        assert bm.page_tables.num_attached == len(live)
        if not live:
            continue
        batch = rng.sample(live, rng.randrange(1, len(live) + 1))
        used = np.array([rng.randrange(1, len(s.page_table) + 1) for s in batch])
        rows = np.array([s.page_table.row for s in batch])
        ids, tags = bm.page_tables.gather(rows, np.array([len(s.page_table) for s in batch]), used)
        for b, s in enumerate(batch):
            assert (ids[b].tolist(), tags[b].tolist()) == _rebuild(s, int(used[b]), int(used.max()))
    for s in live:
        bm.release(s)
    assert bm.page_tables.num_attached == 0 and (bm.page_tables.tags == PAD_TAG).all()
    assert bm.num_available_pages == 40


@pytest.mark.parametrize("seed", range(8))
def test_touching_sequences_quarantines_as_touching_every_page(seed: int) -> None:
    """Two managers take the same random admissions, decodes, preemptions and releases, with steps
    that complete up to three steps late; one records every page of every scheduled sequence (the
    old `touch`), the other only the sequences. As in the scheduler, a step schedules every sequence
    it admitted or gave a page. They hand out, quarantine and free the same pages."""
    rng = random.Random(seed)
    managers = by_page, by_seq = (
        BlockManager(num_pages=24, page_size=S),
        BlockManager(num_pages=24, page_size=S),
    )
    live: list[tuple[Sequence, Sequence]] = []

    def release(pair: tuple[Sequence, Sequence]) -> None:
        live.remove(pair)
        for s, bm in zip(pair, managers, strict=True):
            bm.release(s)

    for step in range(300):
        scheduled = []
        for pair in rng.sample(live, len(live) // 2):  # decode some, finish some
            if rng.random() < 0.2:
                release(pair)
                continue
            token, reserved = rng.randrange(5), []
            for s, bm in zip(pair, managers, strict=True):
                s.num_computed_tokens = s.num_tokens
                bm.publish_full_pages(s)
                s.token_ids.append(token)
                reserved.append(bm.reserve_next_slot(s))
            assert reserved[0] == reserved[1]
            if reserved[0]:
                scheduled.append(pair)
            else:
                release(pair)  # preempted
        if rng.random() < 0.3 or not live:  # small alphabet: prefix-cache hits
            tokens = [rng.randrange(5) for _ in range(rng.randrange(1, 14))]
            pair = _seq(f"s{step}", tokens, TENANT_A), _seq(f"s{step}", list(tokens), TENANT_A)
            admitted = [bm.admit(s) for s, bm in zip(pair, managers, strict=True)]
            assert admitted[0] == admitted[1]
            if admitted[0]:
                live.append(pair)
                scheduled.append(pair)
        scheduled += [p for p in live if p not in scheduled and rng.random() < 0.3]  # prefill chunks
        for a, _ in scheduled:
            by_page.touch(a.page_table.page_id_list(), step)
        by_seq.touch_sequences([b for _, b in scheduled], step)
        done = step - rng.randrange(4)
        if done > by_page.completed_step:
            for bm in managers:
                bm.complete_step(done)
        for a, b in live:
            assert list(a.page_table) == list(b.page_table)
        assert by_page._quarantine.keys() == by_seq._quarantine.keys()
        assert list(by_page._free) == list(by_seq._free) and by_page.refcounts == by_seq.refcounts
    assert by_page.stats == by_seq.stats

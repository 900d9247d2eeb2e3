"""Prefix cache: hits within a tenant, never across; verified keys; LRU eviction; cached tokens reported."""

from __future__ import annotations

import msgspec

from backend.engine.prefix_cache import PrefixCache
from schemas.backend import ImageSpan
from tests.backend.engine_helpers import TENANT_A, TENANT_B, make_engine, prompt_of, request, run_all

PROMPT = prompt_of(11, 40)  # two full pages of 16 and 8 more tokens


def test_same_tenant_hits_other_tenant_misses_on_the_same_prompt() -> None:
    engine = make_engine()
    first = run_all(engine, [request("first", PROMPT)])["first"]
    assert first.num_cached_tokens == 0
    same = run_all(engine, [request("same", PROMPT)])["same"]
    other = run_all(engine, [request("other", PROMPT, tenant=TENANT_B)])["other"]
    assert same.num_cached_tokens == 32 and other.num_cached_tokens == 0  # the paired assertion
    assert engine.stats.prefix_hits == 2 and engine.stats.cached_tokens == 32
    # reusing pages changes nothing a user sees
    assert same.token_ids == first.token_ids == other.token_ids
    assert engine.runner.model.num_forward_calls > 0


def test_a_prompt_that_is_all_full_pages_still_computes_its_last_token() -> None:
    engine = make_engine()
    prompt = prompt_of(12, 32)
    base = run_all(engine, [request("a", prompt)])["a"]
    again = run_all(engine, [request("b", prompt)])["b"]
    assert again.num_cached_tokens == 16 and again.token_ids == base.token_ids


def test_generated_pages_are_cached_for_a_follow_up_turn() -> None:
    engine = make_engine()
    first = run_all(engine, [request("turn1", prompt_of(13, 20), max_tokens=16)])["turn1"]
    follow_up = prompt_of(13, 20) + first.token_ids + [5, 6, 7]  # 39 tokens: pages 0 and 1 computed already
    second = run_all(engine, [request("turn2", follow_up, max_tokens=12)])["turn2"]
    assert second.num_cached_tokens == 32
    # the hit path reads KV that decode steps wrote: it must give what a full prefill gives
    uncached = make_engine(enable_prefix_cache=False)
    assert second.token_ids == run_all(uncached, [request("u", follow_up, max_tokens=12)])["u"].token_ids


def test_eviction_under_pressure_reclaims_unreferenced_pages_lru_first() -> None:
    engine = make_engine(num_pages=8)
    old, recent = prompt_of(21, 33), prompt_of(22, 33)  # 3 pages each, 2 full ones cached after
    run_all(engine, [request("old", old, max_tokens=1)])
    run_all(engine, [request("recent", recent, max_tokens=1)])
    cache = engine.block_manager.prefix_cache
    assert cache is not None and cache.num_cached == 4 and engine.block_manager.num_available_pages == 8
    big = run_all(engine, [request("big", prompt_of(23, 70), max_tokens=10)])["big"]  # needs 5 pages
    assert big.finish_reason == "length" and engine.stats.prefix_evictions == 1
    # "old" was released first, so its first page went; "recent" is still fully cached
    assert run_all(engine, [request("recent2", recent, max_tokens=1)])["recent2"].num_cached_tokens == 32
    assert run_all(engine, [request("old2", old, max_tokens=1)])["old2"].num_cached_tokens == 0
    assert engine.block_manager.num_available_pages == 8


def test_cached_outputs_equal_uncached_outputs() -> None:
    prompts = [PROMPT, PROMPT[:20] + prompt_of(3, 30), PROMPT]
    cached = make_engine()
    uncached = make_engine(enable_prefix_cache=False)
    for i, p in enumerate(prompts):
        a = run_all(cached, [request(f"c{i}", p, max_tokens=12)])[f"c{i}"]
        b = run_all(uncached, [request(f"u{i}", p, max_tokens=12)])[f"u{i}"]
        assert a.token_ids == b.token_ids
    assert cached.stats.prefix_hits == 3  # p1 shares page 0 with PROMPT; p2 is PROMPT again


def test_key_covers_salt_parent_tokens_and_images_and_a_hit_checks_the_stored_key() -> None:
    k = PrefixCache.key(TENANT_A, b"", [1, 2, 3], [])
    variants = [
        PrefixCache.key(TENANT_B, b"", [1, 2, 3], []),
        PrefixCache.key(TENANT_A, b"x", [1, 2, 3], []),
        PrefixCache.key(TENANT_A, b"", [1, 2, 4], []),
        PrefixCache.key(TENANT_A, b"", [1, 2, 3], ["img"]),
    ]
    assert len({k.digest(), *(v.digest() for v in variants)}) == 5
    cache = PrefixCache(page_size=3)
    cache.insert(k.digest(), k, page_id=0, tag=7)
    tags = [7]
    assert cache.peek(k.digest(), k, tags) == 0
    assert cache.peek(k.digest(), variants[2], tags) is None  # a colliding digest with other tokens
    tags[0] = 8  # the page was re-allocated since it was cached
    assert cache.peek(k.digest(), k, tags) is None


def test_image_hash_decides_reuse_of_pages_holding_its_placeholders() -> None:
    engine = make_engine()
    prompt = prompt_of(31, 40)
    span = ImageSpan(offset=4, length=8, image_hash="aa" * 32)
    other_span = ImageSpan(offset=4, length=8, image_hash="bb" * 32)
    run_all(engine, [msgspec.structs.replace(request("a", prompt), image_spans=[span])])
    same = msgspec.structs.replace(request("b", prompt), image_spans=[span])
    other = msgspec.structs.replace(request("c", prompt), image_spans=[other_span])
    assert run_all(engine, [same])["b"].num_cached_tokens == 32
    assert run_all(engine, [other])["c"].num_cached_tokens == 0

"""Prefix caching: full KV pages found again by a hash of everything that determined their content.

A page's key chains SHA-256 over (tenant salt, parent page's key, the page's token ids, hashes of the
images whose placeholders fall in the page), encoded as a typed msgpack tuple so that no field can
run into the next (reliability-anchors §1.2: untyped keys and weak hashes let tenants collide). The
salt comes from the gateway, so two tenants never share a page. A hit is also checked against the
stored key itself, not only its hash.

The cache holds no tensors and never frees: the block manager owns pages and refcounts, and tells
the cache when a cached page stops or starts being referenced; unreferenced cached pages form an
LRU that the block manager evicts from when it runs out of free pages.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

_KEY_VERSION = "kumo-kv-page-v1"


@dataclass(frozen=True, slots=True)
class PageKey:
    tenant_salt: str
    parent: bytes
    token_ids: tuple[int, ...]
    image_hashes: tuple[str, ...]

    def digest(self) -> bytes:
        payload = msgspec.msgpack.encode(
            (
                _KEY_VERSION,
                ("salt", self.tenant_salt),
                ("parent", self.parent),
                ("tokens", self.token_ids),
                ("images", self.image_hashes),
            )
        )
        return hashlib.sha256(payload).digest()


@dataclass(slots=True)
class PrefixCacheStats:
    """`hits` and `evictions` count pages; `misses` counts lookups that stopped at an uncached page."""

    hits: int = 0
    misses: int = 0
    evictions: int = 0
    hit_tokens: int = 0


class PrefixCache:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.stats = PrefixCacheStats()
        self._page_by_hash: dict[bytes, int] = {}
        self._entry_by_page: dict[int, tuple[bytes, PageKey, int]] = {}  # page -> (hash, key, tag)
        self._evictable: OrderedDict[int, None] = OrderedDict()  # refcount-0 cached pages, LRU first
        self._whole_draft_kv: set[int] = set()  # cached pages whose MTP KV is whole

    @staticmethod
    def key(
        tenant_salt: str, parent: bytes, token_ids: Sequence[int], image_hashes: Sequence[str]
    ) -> PageKey:
        return PageKey(tenant_salt, parent, tuple(token_ids), tuple(image_hashes))

    def peek(self, digest: bytes, key: PageKey, current_tags: list[int]) -> int | None:
        """The cached page holding exactly `key` and still carrying the tag it was cached with."""
        page_id = self._page_by_hash.get(digest)
        if page_id is None:
            return None
        _, stored_key, stored_tag = self._entry_by_page[page_id]
        if stored_key != key or current_tags[page_id] != stored_tag:
            return None
        return page_id

    def record_lookup(self, num_hits: int, *, missed: bool) -> None:
        """Count one prefix lookup that reused `num_hits` pages and then missed (or not)."""
        self.stats.hits += num_hits
        self.stats.hit_tokens += num_hits * self.page_size
        self.stats.misses += int(missed)

    def insert(self, digest: bytes, key: PageKey, page_id: int, tag: int) -> bool:
        """Publish a full, computed page. False when that content is already cached elsewhere."""
        if digest in self._page_by_hash or page_id in self._entry_by_page:
            return False
        self._page_by_hash[digest] = page_id
        self._entry_by_page[page_id] = (digest, key, tag)
        return True

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._entry_by_page

    def mark_draft_kv_whole(self, page_id: int) -> None:
        """A holder of `page_id` has written the MTP KV of its every position (if it is cached)."""
        if page_id in self._entry_by_page:
            self._whole_draft_kv.add(page_id)

    def is_draft_kv_whole(self, page_id: int) -> bool:
        return page_id in self._whole_draft_kv

    def mark_unreferenced(self, page_id: int) -> None:
        self._evictable[page_id] = None
        self._evictable.move_to_end(page_id)

    def mark_referenced(self, page_id: int) -> None:
        self._evictable.pop(page_id, None)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._entry_by_page)

    def evict_lru(self) -> int | None:
        """Forget the least recently released unreferenced page and return it, or None."""
        if not self._evictable:
            return None
        page_id, _ = self._evictable.popitem(last=False)
        self.forget(page_id)
        self.stats.evictions += 1
        return page_id

    def forget(self, page_id: int) -> None:
        """Drop a page from the cache (evicted, or its content can no longer be trusted)."""
        entry = self._entry_by_page.pop(page_id, None)
        if entry is not None:
            del self._page_by_hash[entry[0]]
        self._evictable.pop(page_id, None)
        self._whole_draft_kv.discard(page_id)

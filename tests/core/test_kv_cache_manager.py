"""KVCacheManager: exact page ids, ref counts, prefix hits, LRU eviction order."""

from __future__ import annotations

import pytest

from roofline.core import kv_cache_manager
from roofline.core.kv_cache_manager import KVCacheManager, PrefixHit
from roofline.request import Request

PS = 4  # page_size in every test here


def compute(kv: KVCacheManager, req: Request, n: int, hit: PrefixHit | None = None) -> list[int]:
    """Allocate ``n`` new tokens and mark them computed, as schedule() + update() would."""
    block_ids = kv.allocate(req, n, hit)
    assert block_ids is not None
    if hit is not None:
        req.num_computed_tokens = hit.num_cached_tokens
    req.num_computed_tokens += n
    return block_ids


def test_allocation_takes_pages_from_the_head(make_request) -> None:
    kv = KVCacheManager(8, PS, enable_prefix_caching=False)
    a = make_request("a", range(10))
    b = make_request("b", range(5))
    assert compute(kv, a, 10) == [0, 1, 2]
    assert compute(kv, b, 5) == [3, 4]
    assert kv.num_free_pages == 3
    assert kv.usage == pytest.approx(5 / 8)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert kv.get_block_ids("nobody") == []


def test_block_table_grows_only_at_page_boundaries(make_request) -> None:
    kv = KVCacheManager(8, PS, enable_prefix_caching=False)
    a = make_request("a", range(11))
    assert compute(kv, a, 11) == [0, 1, 2]
    a.output_token_ids.append(99)
    assert compute(kv, a, 1) == [0, 1, 2]  # token 12 still fits page 2
    a.output_token_ids.append(98)
    assert compute(kv, a, 1) == [0, 1, 2, 3]  # token 13 opens page 3
    assert kv.num_free_pages == 4


def test_allocate_none_has_no_side_effects(make_request) -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=True)
    a = make_request("a", range(12))
    b = make_request("b", range(100, 108))
    compute(kv, a, 12)
    free_before = kv.free_queue()
    assert kv.allocate(b, 8) is None
    assert kv.get_block_ids("b") == []
    assert kv.free_queue() == free_before == [3]
    assert [kv.ref_count(p) for p in range(4)] == [1, 1, 1, 0]
    assert [kv.is_cached(p) for p in range(4)] == [True, True, True, False]


def test_hit_pages_in_the_free_queue_are_not_free_for_fresh_allocation(make_request) -> None:
    kv = KVCacheManager(5, PS, enable_prefix_caching=True)
    a = make_request("a", range(9))
    c = make_request("c", [50])
    compute(kv, a, 9)  # pages 0, 1 cached; page 2 partial
    compute(kv, c, 1)  # page 3
    kv.free(a)
    assert kv.free_queue() == [4, 2, 1, 0]
    b = make_request("b", list(range(8)) + list(range(200, 209)))  # 17 tokens: 5 pages
    hit = kv.lookup_prefix(b)
    assert hit == PrefixHit([0, 1], 8)
    # 3 fresh pages needed; 4 pages are free but 2 of them are the hit itself.
    assert kv.allocate(b, 9, hit) is None
    assert kv.free_queue() == [4, 2, 1, 0]
    assert kv.get_block_ids("b") == []
    assert kv.is_cached(0) and kv.is_cached(1)
    kv.free(c)
    assert kv.free_queue() == [4, 2, 1, 0, 3]
    assert compute(kv, b, 9, hit) == [0, 1, 4, 2, 3]
    assert kv.num_free_pages == 0


def test_prefix_hit_shares_pages_and_counts_tokens(make_request) -> None:
    kv = KVCacheManager(8, PS, enable_prefix_caching=True)
    a = make_request("a", range(10))
    compute(kv, a, 10)
    b = make_request("b", list(range(8)) + [70, 71, 72, 73])
    hit = kv.lookup_prefix(b)
    assert hit == PrefixHit([0, 1], 8)
    assert (kv.prefix_queries, kv.prefix_hits) == (12, 8)
    assert compute(kv, b, 4, hit) == [0, 1, 3]
    assert b.num_computed_tokens == 12
    assert [kv.ref_count(p) for p in (0, 1, 2, 3)] == [2, 2, 1, 1]
    kv.free(a)
    assert [kv.ref_count(p) for p in (0, 1, 2, 3)] == [1, 1, 0, 1]
    assert kv.free_queue() == [4, 5, 6, 7, 2]  # shared pages stay out of the free queue
    kv.free(b)
    assert kv.free_queue() == [4, 5, 6, 7, 2, 3, 1, 0]
    miss = make_request("m", range(30, 40))
    assert kv.lookup_prefix(miss) == PrefixHit([], 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (22, 8)


def test_hit_leaves_at_least_one_token_to_compute(make_request) -> None:
    kv = KVCacheManager(8, PS, enable_prefix_caching=True)
    a = make_request("a", range(8))
    compute(kv, a, 8)
    assert kv.is_cached(0) and kv.is_cached(1)
    same = make_request("same", range(8))
    assert kv.lookup_prefix(same) == PrefixHit([0], 4)
    longer = make_request("longer", range(9))
    assert kv.lookup_prefix(longer) == PrefixHit([0, 1], 8)
    short = make_request("short", range(4))
    assert kv.lookup_prefix(short) == PrefixHit([], 0)


def test_hash_collision_with_different_tokens_is_not_a_hit(make_request, monkeypatch) -> None:
    monkeypatch.setattr(kv_cache_manager, "hash_page", lambda parent, tokens: 42)
    kv = KVCacheManager(8, PS, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5])
    compute(kv, a, 5)
    assert kv.is_cached(0)
    b = make_request("b", [9, 9, 9, 9, 5])
    assert kv.lookup_prefix(b) == PrefixHit([], 0)
    assert kv.prefix_hits == 0
    assert compute(kv, b, 5) == [2, 3]
    assert not kv.is_cached(2)  # its hash belongs to page 0: not registered
    c = make_request("c", [1, 2, 3, 4, 6])
    assert kv.lookup_prefix(c) == PrefixHit([0], 4)


def test_a_repeated_lookup_checks_the_tokens_as_the_first(make_request, monkeypatch) -> None:
    """A second lookup reuses the first's hashes and rebuilds each page's tokens for the
    collision check; the first uses the tuples it hashed: both refuse a colliding page and
    take a matching one, and one that grew since its first lookup mixes both."""
    monkeypatch.setattr(kv_cache_manager, "hash_page", lambda parent, tokens: hash(parent) % 2)
    kv = KVCacheManager(16, PS, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)  # pages 0 and 1 cached (hashes 0 and 0: page 1's is taken, not cached)
    b = make_request("b", [1, 2, 3, 4, 0, 0, 0, 0, 9])
    for _ in range(2):  # first lookup, then one over the stored hashes
        assert kv.lookup_prefix(b) == PrefixHit([0], 4)
    c = make_request("c", [7, 7, 7, 7, 5])  # same (collided) hash as page 0, other tokens
    for _ in range(2):
        assert kv.lookup_prefix(c) == PrefixHit([], 0)
    d = make_request("d", [1, 2, 3, 4, 5])
    assert kv.lookup_prefix(d) == PrefixHit([0], 4)  # one page hashed
    d.prompt_token_ids += [6, 7, 8, 9]  # (a test's shortcut for a longer known sequence)
    assert kv.lookup_prefix(d) == PrefixHit([0], 4)  # page 0 rebuilt, page 1 hashed now


def test_hit_needs_the_whole_chain(make_request) -> None:
    kv = KVCacheManager(8, PS, enable_prefix_caching=True)
    a = make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9])
    compute(kv, a, 9)
    b = make_request("b", [0, 2, 3, 4, 5, 6, 7, 8, 9])  # same second page, other first page
    assert kv.lookup_prefix(b) == PrefixHit([], 0)


def test_lru_eviction_reuses_tail_pages_first(make_request) -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=True)
    a = make_request("a", range(12))
    compute(kv, a, 12)
    a.output_token_ids.append(500)  # sampled; its page is full and cached
    assert [kv.is_cached(p) for p in range(4)] == [True, True, True, False]
    kv.free(a)
    assert kv.free_queue() == [3, 2, 1, 0]  # reverse block order at the tail
    assert kv.num_free_pages == 4
    c = make_request("c", range(100, 104))
    assert compute(kv, c, 4) == [3]
    d = make_request("d", range(200, 204))
    assert compute(kv, d, 4) == [2]  # a's last page is evicted first (now caching d's)
    kv.free(c)
    kv.free(d)
    assert kv.free_queue() == [1, 0, 3, 2]
    again = make_request("again", list(range(12)) + [500])
    assert kv.lookup_prefix(again) == PrefixHit([0, 1], 8)
    assert compute(kv, again, 5, kv.lookup_prefix(again, count=False)) == [0, 1, 3, 2]
    assert kv.free_queue() == []


def test_free_is_idempotent(make_request) -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=True)
    a = make_request("a", range(6))
    compute(kv, a, 6)
    kv.free(a)
    kv.free(a)
    assert kv.free_queue() == [2, 3, 1, 0]
    assert [kv.ref_count(p) for p in range(4)] == [0, 0, 0, 0]


def test_share_prefix_for_forks(make_request) -> None:
    kv = KVCacheManager(8, PS, enable_prefix_caching=False)
    parent = make_request("p", range(10))
    child = make_request("c", range(10), parent=parent)
    compute(kv, parent, 10)
    assert kv.share_prefix(parent, child, 9) == [0, 1]
    assert [kv.ref_count(p) for p in (0, 1, 2)] == [2, 2, 1]
    child.num_computed_tokens = 8
    assert compute(kv, child, 2) == [0, 1, 3]
    kv.free(parent)
    assert [kv.ref_count(p) for p in (0, 1, 2, 3)] == [1, 1, 0, 1]
    kv.free(child)
    assert kv.free_queue() == [4, 5, 6, 7, 2, 3, 1, 0]
    with pytest.raises(ValueError, match="cannot share"):
        kv.share_prefix(parent, child, 8)


def test_disabled_prefix_caching(make_request) -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=False)
    a = make_request("a", range(9))
    compute(kv, a, 9)
    kv.free(a)
    b = make_request("b", range(9))
    assert kv.lookup_prefix(b) == PrefixHit([], 0)
    assert (kv.prefix_queries, kv.prefix_hits) == (0, 0)
    assert not any(kv.is_cached(p) for p in range(4))


def test_reset_prefix_cache_only_when_idle(make_request) -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=True)
    a = make_request("a", range(9))
    compute(kv, a, 9)
    assert kv.reset_prefix_cache() is False
    assert kv.is_cached(0)
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.lookup_prefix(make_request("b", range(9))) == PrefixHit([], 0)


def test_pages_never_written_leave_the_cache(make_request) -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=True)
    writer = make_request("w", range(9))
    assert kv.allocate(writer, 9) == [0, 1, 2]  # registered, but its step has not run
    reader = make_request("r", range(9))
    hit = kv.lookup_prefix(reader)
    assert hit == PrefixHit([0, 1], 8)  # same-step sharing: written before anyone attends
    assert kv.has_unwritten_shared_pages(writer) is False
    assert kv.allocate(reader, 1, hit) == [0, 1, 3]
    reader.num_computed_tokens = 8
    assert kv.has_unwritten_shared_pages(writer) is True
    assert kv.has_unwritten_shared_pages(reader) is False
    kv.free(reader)
    kv.free(writer)  # preempted before its step ran: num_computed_tokens == 0
    assert not any(kv.is_cached(p) for p in range(4))


def test_can_ever_fit() -> None:
    kv = KVCacheManager(4, PS, enable_prefix_caching=False)
    assert kv.can_ever_fit(16)
    assert not kv.can_ever_fit(17)

"""Paged KV bookkeeping: the page pool, per-page ref counts, LRU free queue and prefix cache.

Pure Python: pages are the integers ``0 .. num_pages - 1`` and nothing here touches a tensor.
A request owns a block table (page ids in sequence order); page ``i`` of it holds the K/V of
tokens ``[i * page_size, (i + 1) * page_size)``. Full pages whose tokens are known are registered
in a hash-chained prefix cache so that later requests with the same prefix reuse them instead of
recomputing; freed pages stay cached ("evictable") until the LRU free queue hands them out again.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from roofline.request import Request

PageKey = tuple[int | None, tuple[int, ...]]
"""What a cached page holds: (hash of the parent page or None for the first page, its tokens)."""


def hash_page(parent_hash: int | None, token_ids: tuple[int, ...]) -> int:
    """Hash of a full page chained to its parent page's hash (tests monkeypatch this)."""
    return hash((parent_hash, token_ids))


class PrefixHit(NamedTuple):
    block_ids: list[int]
    """Cached pages holding the request's first ``num_cached_tokens`` tokens, in order."""
    num_cached_tokens: int
    """Always a multiple of ``page_size`` and smaller than the request's ``num_tokens``."""


class KVCacheManager:
    """Page pool with ref counts, an LRU free queue and a hash-chained prefix cache.

    Invariants:

    * ``ref_count(p) > 0`` exactly for pages held by some request; a page sits in the free
      queue iff its ref count is 0. Shared pages (prefix hits, ``share_prefix`` forks) have a
      ref count above 1 and return to the free queue only when the last holder frees them.
    * Free queue order is LRU: allocation takes from the head, freed pages are appended at the
      tail, and a request's pages are appended in *reverse* block order, so its tail pages are
      reused before its head pages (which are the likelier shared prefixes).
    * A page carries a hash iff it is in the prefix cache map (``hash -> page``). A cached page
      in the free queue is *evictable*: taking it for a fresh allocation drops it from the map.
    * Page hash = ``hash_page(parent_page_hash, tuple(page_tokens))``. The cache stores the
      (parent hash, tokens) key with each page and a hit compares it, so a hash collision with
      different tokens is a miss.
    * Pages are registered when they are allocated for known tokens (the model writes them in
      the same step, before any reader attends). A page that its registering request never
      wrote (it was freed before its step ran, e.g. preempted) is dropped from the cache when
      its ref count reaches 0.
    """

    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages ({num_pages}) and page_size ({page_size}) must be > 0")
        self.num_pages = num_pages
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref = [0] * num_pages
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_pages))
        self._cache: dict[int, int] = {}  # page hash -> page id
        self._page_hash: dict[int, int] = {}  # page id -> its hash (cached pages only)
        self._page_key: dict[int, PageKey] = {}  # page id -> (parent hash, tokens)
        self._blocks: dict[str, list[int]] = {}  # request id -> block table
        self._hashes: dict[str, list[int]] = {}  # request id -> chain hashes of its full pages
        self._num_checked: dict[str, int] = {}  # request id -> pages already tried to register
        self.prefix_queries = 0
        """Tokens looked up in the prefix cache (one request's ``num_tokens`` per lookup)."""
        self.prefix_hits = 0
        """Tokens found in the prefix cache."""

    # ----------------------------------------------------------------- introspection

    @property
    def num_free_pages(self) -> int:
        """Pages with ref count 0 (evictable cached pages included)."""
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of pages held by some request."""
        return (self.num_pages - len(self._free)) / self.num_pages

    def ref_count(self, page_id: int) -> int:
        return self._ref[page_id]

    def is_cached(self, page_id: int) -> bool:
        return page_id in self._page_hash

    def get_block_ids(self, request_id: str) -> list[int]:
        return list(self._blocks.get(request_id, ()))

    def free_queue(self) -> list[int]:
        """The free pages in the order allocation takes them (head first)."""
        return list(self._free)

    def pages_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_ever_fit(self, num_tokens: int) -> bool:
        """Whether a sequence of ``num_tokens`` tokens fits in the whole pool."""
        return self.pages_needed(num_tokens) <= self.num_pages

    # ----------------------------------------------------------------- prefix cache

    def _chain_hashes(
        self, request: Request, num_pages: int, built: list[tuple[int, ...]] | None = None
    ) -> list[int]:
        """The request's chain hashes for (at least) its first ``num_pages`` full pages;
        ``built`` (if given) receives the token tuples of the pages hashed by this call."""
        hashes = self._hashes.setdefault(request.request_id, [])
        if len(hashes) < num_pages:
            ps = self.page_size
            for i in range(len(hashes), num_pages):
                parent = hashes[-1] if hashes else None
                tokens = _token_slice(request, i * ps, (i + 1) * ps)
                if built is not None:
                    built.append(tokens)
                hashes.append(hash_page(parent, tokens))
        return hashes

    def lookup_prefix(self, request: Request, count: bool = True) -> PrefixHit:
        """Longest chain of cached full pages matching the start of ``request.all_token_ids``.

        Never covers the whole sequence: at least one token is left to compute, so the hit is
        capped at the largest page multiple <= ``num_tokens - 1``. Takes no references; pass
        the hit to :meth:`allocate` before anything else allocates or frees. ``count=False``
        keeps a repeated lookup out of the metrics.
        """
        if not self.enable_prefix_caching:
            return PrefixHit([], 0)
        num_tokens = request.num_tokens
        max_pages = (num_tokens - 1) // self.page_size
        num_hashed = len(self._hashes.get(request.request_id, ()))
        built: list[tuple[int, ...]] = []  # pages num_hashed.. : their tuples, made once
        hashes = self._chain_hashes(request, max_pages, built)
        tokens = request.all_token_ids if num_hashed else None
        ps = self.page_size
        cache_get, page_key = self._cache.get, self._page_key
        block_ids: list[int] = []
        for i in range(max_pages):
            page = cache_get(hashes[i])
            if page is None:
                break
            parent = hashes[i - 1] if i > 0 else None
            if i >= num_hashed:
                page_tokens = built[i - num_hashed]
            else:  # hashed by an earlier lookup
                page_tokens = tuple(tokens[i * ps : (i + 1) * ps])  # type: ignore[index]
            if page_key[page] != (parent, page_tokens):
                break  # hash collision: same hash, different content
            block_ids.append(page)
        hit = PrefixHit(block_ids, len(block_ids) * ps)
        if count:
            self.prefix_queries += num_tokens
            self.prefix_hits += hit.num_cached_tokens
        return hit

    def _register_full_pages(self, request: Request, num_known_tokens: int) -> None:
        """Put the request's full pages among its first ``num_known_tokens`` tokens in the cache.

        A page already cached (a hit or shared page) is left alone; a page whose hash is taken
        by another page (same content computed twice, or a collision) is not registered.
        """
        rid = request.request_id
        num_full = num_known_tokens // self.page_size
        start = self._num_checked.get(rid, 0)
        if num_full <= start:
            return
        hashes = self._chain_hashes(request, num_full)
        blocks = self._blocks[rid]
        ps = self.page_size
        for i in range(start, num_full):
            page = blocks[i]
            if page in self._page_hash or hashes[i] in self._cache:
                continue
            parent = hashes[i - 1] if i > 0 else None
            self._cache[hashes[i]] = page
            self._page_hash[page] = hashes[i]
            self._page_key[page] = (parent, _token_slice(request, i * ps, (i + 1) * ps))
        self._num_checked[rid] = num_full

    def _uncache(self, page: int) -> None:
        page_hash = self._page_hash.pop(page, None)
        if page_hash is not None:
            del self._cache[page_hash]
            del self._page_key[page]

    def reset_prefix_cache(self) -> bool:
        """Forget every cached page; refused (False) while any page is held by a request."""
        if len(self._free) != self.num_pages:
            return False
        self._cache.clear()
        self._page_hash.clear()
        self._page_key.clear()
        return True

    # ----------------------------------------------------------------- allocation

    def allocate(
        self, request: Request, num_new_tokens: int, prefix_hit: PrefixHit | None = None
    ) -> list[int] | None:
        """Grow the request's block table to cover its computed tokens plus ``num_new_tokens``.

        With ``prefix_hit`` (only for a request holding no pages) the hit's pages come first
        and count as computed. Returns the whole block table, or None, with no side effect at
        all, when the free pages are too few (hit pages sitting in the free queue do not count
        as available for the fresh pages). When no page is added (most decode steps) the
        returned list is the manager's own, not a copy: read it within the step (the runner
        lays the step out from it), do not keep it: later allocations append to it.
        """
        rid = request.request_id
        blocks = self._blocks.get(rid)
        if blocks is None:
            blocks = []
        elif prefix_hit is None:  # a running request: most steps need no new page
            live = self.covered(
                request,
                request.num_computed_tokens + num_new_tokens,
                len(request.prompt_token_ids) + len(request.output_token_ids),
            )
            if live is not None:
                return live  # the live list, uncopied (docstring)
        hit_pages = prefix_hit.block_ids if prefix_hit is not None else []
        if hit_pages and blocks:
            raise ValueError(f"request {rid} already holds pages; a prefix hit cannot be added")
        num_computed = prefix_hit.num_cached_tokens if hit_pages else request.num_computed_tokens
        num_known = num_computed + num_new_tokens
        num_fresh = self.pages_needed(num_known) - len(blocks) - len(hit_pages)
        hit_in_free = sum(1 for p in hit_pages if self._ref[p] == 0)
        if num_fresh > len(self._free) - hit_in_free:
            return None
        blocks = self._blocks.setdefault(rid, blocks)
        for page in hit_pages:
            if self._ref[page] == 0:
                del self._free[page]
            self._ref[page] += 1
            blocks.append(page)
        for _ in range(max(num_fresh, 0)):
            page, _ = self._free.popitem(last=False)
            self._uncache(page)  # evict whatever this page held
            self._ref[page] = 1
            blocks.append(page)
        if hit_pages:
            self._num_checked[rid] = len(hit_pages)
        if self.enable_prefix_caching:  # pending tokens (async scheduling) have no ids yet
            self._register_full_pages(request, min(num_known, request.num_known_tokens))
        return list(blocks)

    def covered(self, request: Request, num_tokens: int, num_known_ids: int) -> list[int] | None:
        """``allocate``'s common case for a running request: when its pages already cover its
        first ``num_tokens`` tokens (computed plus new), its live block table (registering the
        full pages among its first ``num_known_ids`` tokens, ``request.num_known_tokens``, in
        the prefix cache as ``allocate`` does); else None and nothing changes (``allocate``
        adds the pages). Called once per running request per step: kept lean."""
        blocks = self._blocks.get(request.request_id)
        if blocks is None or len(blocks) * self.page_size < num_tokens:
            return None
        if self.enable_prefix_caching:
            if num_known_ids > num_tokens:
                num_known_ids = num_tokens
            if num_known_ids // self.page_size > self._num_checked.get(request.request_id, 0):
                self._register_full_pages(request, num_known_ids)
        return blocks

    def append_page(
        self, request: Request, num_tokens: int, num_known_ids: int
    ) -> list[int] | None:
        """``allocate(request, 1)`` where its pages end exactly at its computed tokens (a
        decode step reaching a page boundary; ``covered`` said no): one free page appended, the
        full pages among its first ``min(num_tokens, num_known_ids)`` tokens registered as
        ``allocate`` does; the block table (a copy), or None with nothing changed when no page
        is free. (Steady decode calls it for a few rows every step: ``core/steady.py``.)"""
        if not self._free:
            return None
        blocks = self._blocks[request.request_id]
        page, _ = self._free.popitem(last=False)
        self._uncache(page)  # evict whatever this page held
        self._ref[page] = 1
        blocks.append(page)
        if self.enable_prefix_caching:
            self._register_full_pages(request, min(num_tokens, num_known_ids))
        return list(blocks)

    def share_prefix(
        self, src_request: Request, dst_request: Request, num_tokens: int
    ) -> list[int]:
        """Give ``dst_request`` (holding no pages) ``src_request``'s first
        ``num_tokens // page_size`` pages, one more reference each; returns those page ids.

        The caller guarantees both requests have the same first ``num_tokens`` tokens and that
        ``src_request`` has computed them.
        """
        num_shared = num_tokens // self.page_size
        src_blocks = self._blocks.get(src_request.request_id, [])
        if len(src_blocks) < num_shared:
            raise ValueError(
                f"request {src_request.request_id} holds {len(src_blocks)} pages, "
                f"cannot share {num_shared}"
            )
        if self._blocks.get(dst_request.request_id):
            raise ValueError(f"request {dst_request.request_id} already holds pages")
        shared = src_blocks[:num_shared]
        for page in shared:
            self._ref[page] += 1
        self._blocks[dst_request.request_id] = list(shared)
        self._num_checked[dst_request.request_id] = num_shared
        return list(shared)

    def free(self, request: Request) -> None:
        """Drop the request's references (idempotent). Pages reaching ref 0 go to the free
        queue's tail in reverse block order; those the request registered but never wrote
        (beyond its ``num_computed_tokens``) leave the prefix cache."""
        rid = request.request_id
        blocks = self._blocks.pop(rid, [])
        self._hashes.pop(rid, None)
        self._num_checked.pop(rid, None)
        num_written = request.num_computed_tokens // self.page_size
        for i in range(len(blocks) - 1, -1, -1):
            page = blocks[i]
            self._ref[page] -= 1
            if self._ref[page] == 0:
                if i >= num_written:
                    self._uncache(page)
                self._free[page] = None

    def trim(self, request: Request, num_tokens: int) -> None:
        """Shrink the request's block table to the pages covering its first ``num_tokens``
        tokens (speculative decoding rolls back rejected proposals). Dropped pages return to
        the free queue's tail when no one else holds them; they never hold cached content,
        since pages are registered only over known (accepted) tokens."""
        rid = request.request_id
        blocks = self._blocks.get(rid)
        keep = self.pages_needed(num_tokens)
        if blocks is None or len(blocks) <= keep:
            return
        for i in range(len(blocks) - 1, keep - 1, -1):
            page = blocks[i]
            self._ref[page] -= 1
            if self._ref[page] == 0:
                self._uncache(page)
                self._free[page] = None
        del blocks[keep:]
        if self._num_checked.get(rid, 0) > keep:
            self._num_checked[rid] = keep

    def has_unwritten_shared_pages(self, request: Request) -> bool:
        """Whether another request holds a page this request allocated but has not written yet
        (a same-step prefix hit on it). Freeing such a request before its step runs would leave
        the other reader attending garbage, so the scheduler must not preempt it."""
        blocks = self._blocks.get(request.request_id, [])
        num_written = request.num_computed_tokens // self.page_size
        return any(self._ref[p] > 1 for p in blocks[num_written:])


def _token_slice(request: Request, start: int, end: int) -> tuple[int, ...]:
    """``tuple(request.all_token_ids[start:end])`` without concatenating the whole sequence
    (a decode step fills a page every ``page_size`` steps: O(page), not O(context))."""
    prompt = request.prompt_token_ids
    num_prompt = len(prompt)
    if end <= num_prompt:
        return tuple(prompt[start:end])
    output = request.output_token_ids
    if start >= num_prompt:
        return tuple(output[start - num_prompt : end - num_prompt])
    return tuple(prompt[start:]) + tuple(output[: end - num_prompt])

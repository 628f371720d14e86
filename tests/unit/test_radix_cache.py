"""The prefix cache's bookkeeping without a model: the tree of pages, and the cache
manager's reference counts, LRU eviction and page states under random interleavings."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minisgl.core import Req, SamplingParams
from minisgl.kvcache.allocator import OutOfPages
from minisgl.scheduler.cache import CacheManager
from minisgl.scheduler.radix import RadixCache

PS = 2  # tokens per page


# ---------------------------------------------------------------------------- the tree
def test_match_follows_whole_pages_of_the_longest_cached_prefix() -> None:
    tree = RadixCache(PS)
    assert tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]) == [10, 11, 12]
    assert tree.match([1, 2, 3, 4, 5, 6, 7], 9) == [10, 11, 12]
    assert tree.match([1, 2, 3, 9], 9) == [10]  # the second page differs
    assert tree.match([1, 2, 3], 9) == [10]  # a partial page never matches
    assert tree.match([1, 2, 3, 4, 5, 6], 2) == [10, 11]  # at most max_pages
    assert tree.match([2, 1], 9) == []


def test_insert_keeps_the_trees_pages_where_the_prefix_is_cached_already() -> None:
    tree = RadixCache(PS)
    tree.insert([1, 2, 3, 4], [10, 11])
    # the same prefix computed again in pages 20, 21, and a page after it
    assert tree.insert([1, 2, 3, 4, 5, 6], [20, 21, 22]) == [22]
    assert tree.match([1, 2, 3, 4, 5, 6], 9) == [10, 11, 22]
    assert 20 not in tree and 22 in tree and len(tree) == 3
    with pytest.raises(ValueError, match="another prefix"):
        tree.insert([7, 8], [10])  # one page cannot hold two prefixes


def test_remove_takes_the_subtree_with_it() -> None:
    tree = RadixCache(PS)
    tree.insert([1, 2, 3, 4, 5, 6], [10, 11, 12])
    tree.insert([1, 2, 3, 4, 7, 8], [10, 11, 13])
    tree.insert([1, 2, 9, 9], [10, 14])
    assert sorted(tree.remove(11)) == [11, 12, 13]
    assert tree.match([1, 2, 3, 4, 5, 6], 9) == [10]
    assert tree.match([1, 2, 9, 9], 9) == [10, 14] and len(tree) == 2
    assert sorted(tree.clear()) == [10, 14] and len(tree) == 0


# ---------------------------------------------------------------------------- the manager
def _manager(num_pages: int, prefix_cache: bool = True) -> CacheManager:
    return CacheManager(num_pages, PS, prefix_cache=prefix_cache)


def _req(uid: int, tokens: list[int], slot: int = 0) -> Req:
    return Req(uid, list(tokens), len(tokens), 64, SamplingParams(), seed=0, table_idx=slot)


def _compute(cache: CacheManager, req: Req) -> None:
    """What a prefill does to the cache's view: pages for every token, all computed."""
    cache.grow(req, len(req.token_ids))
    req.cached_len = len(req.token_ids)


@given(st.lists(st.tuples(st.integers(0, 9 * PS), st.integers(0, 10)), max_size=12))
def test_a_decode_step_needs_the_pages_of_one_more_token(shapes) -> None:
    """`next_token_pages` (written out for the hot path) is `pages_needed` of one more token."""
    cache = _manager(64)
    reqs = []
    for uid, (cached_len, held) in enumerate(shapes):
        req = _req(uid, list(range(cached_len + 1)))
        req.cached_len, req.pages = cached_len, list(range(held))
        reqs.append(req)
    assert cache.next_token_pages(reqs) == [cache.pages_needed(r, r.cached_len + 1) for r in reqs]
    holding = [r for r in reqs if len(r.pages) * PS >= r.cached_len]  # pages for every token
    assert set(cache.next_token_pages(holding)) <= {0, 1}


def test_a_finished_prefix_is_reused_and_counted() -> None:
    cache = _manager(8)
    a = _req(0, [1, 2, 3, 4, 5])
    cache.match(a)
    _compute(cache, a)
    cache.insert(a)
    cache.release(a)
    assert cache.used == 0 and cache.cached == 2 and cache.nodes == 2  # two full pages
    b = _req(1, [1, 2, 3, 4, 6, 7], slot=1)
    assert cache.match(b) == 4 and b.cached_len == 4
    assert cache.used == 2 and cache.cached == 0  # referenced again, not cached-only
    assert (cache.query_tokens, cache.hit_tokens) == (5 + 6, 4)


def test_the_last_token_is_always_left_to_compute() -> None:
    cache = _manager(8)
    a = _req(0, [1, 2, 3, 4])
    _compute(cache, a)
    cache.insert(a)
    cache.release(a)
    same = _req(1, [1, 2, 3, 4])
    assert cache.match(same) == 2  # the second page holds the last token: recomputed


def test_eviction_takes_least_recently_used_pages_first_and_never_a_held_one() -> None:
    cache = _manager(4)
    old, new = _req(0, [1, 2, 3, 4]), _req(1, [5, 6, 7, 8], slot=1)
    for r in (old, new):
        _compute(cache, r)
        cache.insert(r)
        cache.release(r)
    assert cache.available == 4 and cache.cached == 4
    held = _req(2, [5, 6, 7], slot=2)
    assert cache.match(held) == 2  # holds new's first page
    grow = _req(3, [0] * 6, slot=3)
    cache.grow(grow, 6)  # needs 3 pages: 0 free, so 3 cached ones go, oldest first
    assert cache.evicted_pages == 3
    assert held.pages[0] not in grow.pages and cache.nodes == 1
    assert cache.match(_req(4, [1, 2, 3, 4, 0], slot=4)) == 0  # old's pages are gone
    with pytest.raises(OutOfPages):  # what a running sequence holds is never taken
        cache.grow(_req(5, [0] * 2, slot=5), 2)


def test_flush_cache_frees_every_cached_page_only_when_idle() -> None:
    cache = _manager(8)
    a = _req(0, [1, 2, 3, 4, 5])
    _compute(cache, a)
    cache.insert(a)
    with pytest.raises(RuntimeError, match="no request in flight"):
        cache.flush_cache()
    cache.release(a)
    assert cache.flush_cache() == 2
    assert cache.allocator.available == 8 and cache.nodes == 0 and cache.cached == 0


def test_no_prefix_cache_frees_pages_at_once() -> None:
    cache = _manager(8, prefix_cache=False)
    a = _req(0, [1, 2, 3, 4, 5])
    _compute(cache, a)
    cache.insert(a)
    cache.release(a)
    assert cache.allocator.available == 8 and cache.match(_req(1, [1, 2, 3, 4, 5])) == 0


def test_evicting_a_prefix_spares_a_page_held_under_it() -> None:
    # two sequences computed the same prefix in one step: the tree keeps the first's pages,
    # and the second's next page hangs under them while the second holds it
    cache = _manager(8)
    a, b = _req(0, [1, 1, 2, 2]), _req(1, [1, 1, 2, 2, 3, 3, 4], slot=1)
    for r in (a, b):
        cache.match(r)
        _compute(cache, r)
    cache.insert(a)
    cache.insert(b)
    b_own = b.pages[2]  # holds [3, 3], under a's page of [2, 2]
    assert cache.nodes == 3 and b_own in cache.tree
    cache.release(a)  # a's two pages: cached only
    cache.grow(_req(2, [0] * 4, slot=2), 4)  # 2 pages: 2 free, 0 to evict
    cache.grow(_req(3, [0] * 4, slot=3), 4)  # 2 pages: a's go, with b's page under them
    assert b_own not in cache.tree and cache._holders[b_own] == 1  # uncached, still b's
    assert b_own not in cache.allocator._free
    cache.release(b)  # and freed when b lets go, not cached
    assert cache.cached == 0 and b_own in cache.allocator._free


# ---------------------------------------------------------------------------- interleavings
BASES = [[1, 1, 2, 2, 3, 3, 4, 4], [1, 1, 2, 2, 5, 5, 6, 6], [7, 7, 8, 8, 9, 9, 1, 1]]
OPS = ["admit", "admit", "decode", "finish", "abort", "flush"]


def _interleaving(rng, length: int) -> list[tuple[str, int, list[int]]]:
    """(operation, which live sequence, tokens) triples. A prompt is a cut of one of a few
    shared sequences plus a tail of its own, so prefixes recur; a decode appends the first
    token. Random rather than built from hypothesis's list strategies: those favour short,
    simple lists, which never reach the orderings that matter here (a prefix computed
    twice in one step, then evicted while the second copy's next page is held)."""
    ops = []
    for _ in range(length):
        cut = rng.randint(0, 8)
        tail = [rng.randint(0, 9) for _ in range(rng.randint(0, 3))]
        tokens = BASES[rng.randrange(len(BASES))][:cut] + tail or [0]
        ops.append((rng.choice(OPS), rng.randint(0, 7), tokens))
    return ops


@settings(max_examples=400, deadline=None)
@given(rng=st.randoms(use_true_random=False), length=st.integers(0, 80))
def test_page_states_stay_consistent_under_random_interleavings(rng, length) -> None:
    num_pages = 8
    cache = _manager(num_pages)
    live: list[Req] = []
    written: dict[int, tuple[int, ...]] = {}  # page -> the tokens whose K/V it holds
    uid = 0

    def write(req: Req, start: int) -> None:
        """The model writes K/V for tokens from `start` on into the sequence's pages."""
        for i in range(start // PS, -(-len(req.token_ids) // PS)):
            written[req.pages[i]] = tuple(req.token_ids[i * PS : (i + 1) * PS])

    staged: list[Req] = []  # admitted in this step: matched before any of them is inserted
    for op, pick, tokens in _interleaving(rng, length):
        if op != "admit":  # the step is launched: its prompts' pages become shareable
            for req in staged:
                cache.insert(req)
            staged.clear()
        if op == "admit" and len(live) < 8:
            slot = min(set(range(8)) - {r.table_idx for r in live})
            req = _req(uid, tokens, slot)
            uid += 1
            hit = cache.match(req)
            for i, page in enumerate(req.pages):  # a match is K/V of the same tokens
                assert written[page] == tuple(tokens[i * PS : (i + 1) * PS])
            if cache.pages_needed(req, len(tokens)) > cache.available:
                cache.release(req)  # no room: it waits (here: it goes away)
                continue
            _compute(cache, req)
            write(req, hit)
            staged.append(req)  # two of a step may compute the same prefix twice
            live.append(req)
        elif op == "decode" and live:
            req = live[pick % len(live)]
            req.token_ids.append(tokens[0])
            if cache.pages_needed(req, len(req.token_ids)) > cache.available:
                req.token_ids.pop()  # a scheduler would preempt someone; here: skip
                continue
            _compute(cache, req)
            write(req, len(req.token_ids) - 1)
        elif op in ("finish", "abort") and live:
            req = live.pop(pick % len(live))
            if op == "finish":
                cache.insert(req)
            cache.release(req)
        elif op == "flush" and not live:
            cache.flush_cache()
        _check(cache, live, num_pages)
    for req in live:
        cache.release(req)
    _check(cache, [], num_pages)
    assert cache.used == 0


def _check(cache: CacheManager, live: list[Req], num_pages: int) -> None:
    holders = [0] * num_pages
    for req in live:
        for page in req.pages:
            holders[page] += 1
    assert cache._holders == holders  # every reference is a live sequence's
    free = set(cache.allocator._free)
    cached = set(cache._unreferenced)
    referenced = {p for p in range(num_pages) if holders[p]}
    # every page in exactly one state
    assert free | cached | referenced == set(range(num_pages))
    assert not (free & cached) and not (free & referenced) and not (cached & referenced)
    assert all(p in cache.tree for p in cached)
    assert cache.used == len(referenced) and cache.cached == len(cached)
    assert cache.available == len(free) + len(cached)

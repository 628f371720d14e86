"""CacheManager: KV pages of each sequence, the page-table entries that changed, and the
prefix cache that keeps finished prefixes' pages for reuse.

Contract: `pages_needed(req, length)` says how many more pages `req` needs to hold `length`
tokens, and `next_token_pages(reqs)` how many (0 or 1) each of `reqs` needs for its next
token; `grow(req, length)` takes them (evicting cached pages first if the allocator is
short) and records them for the sequence's row of the page table; `bind(req)` records all
its pages for a freshly assigned row; `take_edits()` hands over what was recorded since
the last call, as flat (row, column, page) triples. It never touches the page table
itself, which is the engine's (on its device): the step loop passes the edits to
`Engine.write_pages` once per step, before the step is launched (scheduler.py).
`release(req)` gives its pages back. Pages are taken as a sequence grows
(one page at a time when decoding), never reserved ahead.

Pages can be shared: the choices of one request (n > 1) share the pages of their common
prompt (`share`), and with the prefix cache on (`prefix_cache=True`) any sequence shares
the cached pages of the longest prefix it has in common with earlier ones (`match`, before
its first prefill chunk). `insert(req)` offers a sequence's computed full pages to the
cache (the scheduler does it when a prompt chunk is computed and when a sequence finishes).

Every page is in exactly one of three states:
- free: in the allocator;
- referenced: held by one or more live sequences (`_holders[page]` of them), whether or not
  the cache holds it too;
- cached: held by the cache alone, in `_unreferenced`, least recently released first.
A page becomes cached when its last holder releases it while the tree holds it, and goes
back to referenced when a sequence matches it. When the allocator runs short, cached pages
are evicted least recently used first (with their subtree: a page whose prefix is gone can
never be matched); `available` counts them, so a scheduler that asks for room sees them as
free and evicts them before it ever preempts a running request. `used` counts referenced
pages only: it is what /debug/lifecycle reports as kv_pages_used and returns to zero when
no request is in flight; `cached` is the rest of what the cache holds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from minisgl.core import Req
from minisgl.kvcache import PageAllocator

from .radix import RadixCache


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, prefix_cache: bool = False) -> None:
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self._holders = [0] * num_pages  # live sequences holding each page
        self._edits: list[int] = []  # (row, column, page) triples not handed over yet
        self.tree = RadixCache(page_size) if prefix_cache else None
        # pages held by the cache alone, least recently released first
        self._unreferenced: OrderedDict[int, None] = OrderedDict()
        self.query_tokens = 0  # prompt tokens looked up in the cache since start
        self.hit_tokens = 0  # of which found there
        self.evicted_pages = 0  # cached pages freed to make room since start

    @property
    def available(self) -> int:
        """Pages a sequence can take: free ones and cached ones (evicted on demand)."""
        return self.allocator.available + len(self._unreferenced)

    @property
    def used(self) -> int:
        """Pages held by live sequences."""
        return self.allocator.used - len(self._unreferenced)

    @property
    def cached(self) -> int:
        """Pages held by the prefix cache alone."""
        return len(self._unreferenced)

    @property
    def total(self) -> int:
        return self.allocator.num_pages

    @property
    def nodes(self) -> int:
        """Pages in the prefix cache's tree, referenced or not."""
        return len(self.tree) if self.tree is not None else 0

    def counts(self) -> dict[str, int]:
        """Its share of the scheduler's state answer (/debug/lifecycle, /metrics)."""
        return {
            "kv_pages_used": self.used,  # held by live requests
            "kv_pages_total": self.total,
            "kv_pages_cached": self.cached,  # held by the prefix cache alone
            "prefix_cache_nodes": self.nodes,
            "prefix_cache_query_tokens": self.query_tokens,
            "prefix_cache_hit_tokens": self.hit_tokens,
        }

    def pages_needed(self, req: Req, length: int) -> int:
        return max(0, -(-length // self.page_size) - len(req.pages))

    def next_token_pages(self, reqs: Iterable[Req]) -> list[int]:
        """`pages_needed(r, r.cached_len + 1)` for each of `reqs`: what a decode step needs.
        Written out, not a call per request: it runs for every request of every step."""
        ps = self.page_size
        return [max(0, r.cached_len // ps + 1 - len(r.pages)) for r in reqs]

    def grow(self, req: Req, length: int) -> None:
        n = self.pages_needed(req, length)
        if n == 0:
            return
        new = self._allocate(n)
        for page in new:
            self._holders[page] = 1
        start = len(req.pages)
        req.pages.extend(new)
        self._record(req.table_idx, start, new)

    def bind(self, req: Req) -> None:
        """Record every page the sequence already holds for its (new) table row."""
        self._record(req.table_idx, 0, req.pages)

    def _record(self, row: int, start: int, pages: list[int]) -> None:
        for col, page in enumerate(pages, start):
            self._edits += (row, col, page)

    def take_edits(self) -> list[int]:
        """The page-table entries recorded since the last call: (row, column, page) triples,
        flat, for the engine to write (`Engine.write_pages`)."""
        edits, self._edits = self._edits, []
        return edits

    def share(self, source: Req, target: Req, num_pages: int) -> None:
        """`target` holds the first `num_pages` pages of `source` too (read-only prefix)."""
        target.pages = source.pages[:num_pages]
        for page in target.pages:
            self._ref(page)

    def release(self, req: Req) -> None:
        # deepest page first: in the LRU order a prefix outlives what was cached under it
        freed = [page for page in reversed(req.pages) if self._unref(page)]
        self.allocator.free(freed)
        req.pages = []

    def _ref(self, page: int) -> None:
        if self._holders[page] == 0:
            del self._unreferenced[page]  # a cached page back in use
        self._holders[page] += 1

    def _unref(self, page: int) -> bool:
        """Drop one holder; True if the page is now free (else maybe cached)."""
        self._holders[page] -= 1
        if self._holders[page] > 0:
            return False
        if self.tree is not None and page in self.tree:
            self._unreferenced[page] = None  # the most recently used of the cached pages
            return False
        return True

    # --8<-- [start:evict]
    def _allocate(self, n: int) -> list[int]:
        """n free pages, evicting cached ones, least recently used first, if needed."""
        short = n - self.allocator.available
        while short > 0 and self._unreferenced:  # else the allocator says it is out
            oldest = next(iter(self._unreferenced))
            freed = []
            for page in self.tree.remove(oldest):  # the page and what hangs under it
                if self._holders[page] == 0:
                    del self._unreferenced[page]
                    freed.append(page)
                # else: a live sequence still holds it; it is freed when released
            self.allocator.free(freed)
            self.evicted_pages += len(freed)
            short -= len(freed)
        return self.allocator.allocate(n)

    # --8<-- [end:evict]

    # --8<-- [start:match]
    def match(self, req: Req) -> int:
        """Before a sequence's first chunk: take the cached pages of the longest prefix of
        its tokens, leaving at least its last token to compute (the step samples from its
        output). Returns the tokens matched; `req.cached_len` moves past them."""
        assert not req.pages and req.cached_len == 0, f"{req} already holds pages"
        if self.tree is None:
            return 0
        known = len(req.token_ids)
        salt = req.sampling_params.cache_salt
        pages = self.tree.match(req.token_ids, (known - 1) // self.page_size, salt)
        for page in pages:
            self._ref(page)
        req.pages = pages
        req.cached_len = len(pages) * self.page_size
        self.query_tokens += known
        self.hit_tokens += req.cached_len
        return req.cached_len

    # --8<-- [end:match]

    def insert(self, req: Req) -> None:
        """Offer the sequence's full pages of computed tokens (`cached_len`) to the cache."""
        if self.tree is None:
            return
        # a decode may have fed a token still pending (not in token_ids yet): not its page
        full = min(req.cached_len, len(req.token_ids)) // self.page_size
        self.tree.insert(req.token_ids, req.pages[:full], req.sampling_params.cache_salt)

    def flush_cache(self) -> int:
        """Drop every cached page (no live sequence may hold any); returns how many."""
        if self.tree is None:
            return 0
        if self.used:
            raise RuntimeError("the prefix cache can only be flushed with no request in flight")
        pages = self.tree.clear()
        self._unreferenced.clear()
        self.allocator.free(pages)
        return len(pages)

"""CacheManager: KV pages of each request, kept in step with the engine's page table.

Contract: `pages_needed(req, length)` says how many more pages `req` needs to hold `length`
tokens; `grow(req, length)` takes them from the allocator and writes them into the request's
row of the page table; `release(req)` returns all of a request's pages. Pages are taken as
the request grows, one page at a time for a decoding request, never reserved ahead.
"""

from __future__ import annotations

import torch

from minisgl.core import Req
from minisgl.kvcache import PageAllocator


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor) -> None:
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.page_table = page_table  # (slots + 1, max_pages) int32, host

    @property
    def available(self) -> int:
        return self.allocator.available

    @property
    def used(self) -> int:
        return self.allocator.used

    @property
    def total(self) -> int:
        return self.allocator.num_pages

    def pages_needed(self, req: Req, length: int) -> int:
        return max(0, -(-length // self.page_size) - len(req.pages))

    def grow(self, req: Req, length: int) -> None:
        n = self.pages_needed(req, length)
        if n == 0:
            return
        new = self.allocator.allocate(n)
        start = len(req.pages)
        req.pages.extend(new)
        self.page_table[req.table_idx, start : start + n] = torch.tensor(new, dtype=torch.int32)

    def release(self, req: Req) -> None:
        self.allocator.free(req.pages)
        req.pages = []

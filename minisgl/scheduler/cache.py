"""CacheManager: KV pages of each sequence, kept in step with the engine's page table.

Contract: `pages_needed(req, length)` says how many more pages `req` needs to hold `length`
tokens; `grow(req, length)` takes them from the allocator and records them for the
sequence's row of the page table; `bind(req)` records all its pages for a freshly assigned
row; `flush()` writes what was recorded into the page table (on the engine's device) in one
operation, and is called once per step before the step is launched; `release(req)` gives
its pages back. Pages are taken as a sequence grows (one page at a time when decoding),
never reserved ahead.

Pages can be shared: the choices of one request (n > 1) share the pages of their common
prompt (`share`). A page returns to the allocator when its last holder releases it.
"""

from __future__ import annotations

import torch

from minisgl.core import Req
from minisgl.engine.staging import Staging
from minisgl.kvcache import PageAllocator


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, page_table: torch.Tensor) -> None:
        self.allocator = PageAllocator(num_pages)
        self.page_size = page_size
        self.page_table = page_table  # (slots + 1, max_pages) int32, on the engine's device
        self._staging = Staging(page_table.device)
        self._holders = [0] * num_pages  # sequences holding each page
        self._edits: list[int] = []  # (row, column, page) triples not yet in page_table

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

    # --8<-- [start:flush]
    def flush(self) -> None:
        """Write the recorded page ids into the page table: one copy to the device."""
        if not self._edits:
            return
        edits = self._staging.to_device(self._edits, torch.int32).view(-1, 3)
        rows, cols = edits[:, 0].long(), edits[:, 1].long()
        self.page_table.index_put_((rows, cols), edits[:, 2])
        self._edits = []

    # --8<-- [end:flush]

    def share(self, source: Req, target: Req, num_pages: int) -> None:
        """`target` holds the first `num_pages` pages of `source` too (read-only prefix)."""
        shared = source.pages[:num_pages]
        for page in shared:
            self._holders[page] += 1
        target.pages = list(shared)

    def release(self, req: Req) -> None:
        freed = []
        for page in req.pages:
            self._holders[page] -= 1
            if self._holders[page] == 0:
                freed.append(page)
        self.allocator.free(freed)
        req.pages = []

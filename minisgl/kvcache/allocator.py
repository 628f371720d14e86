"""PageAllocator: which pages of the pool are free.

Contract: pages are plain ints in [0, num_pages). `allocate(n)` hands out n distinct free
pages or raises; `free(pages)` takes them back, and refuses a page that is not out (a double
free is a bug that would let two requests write the same cache rows). `used` is what
/debug/lifecycle reports as kv_pages_used. `pages_for(tokens, page_size)` is the one page
formula: how many pages hold that many tokens of one sequence.
"""

from __future__ import annotations

from collections.abc import Iterable


def pages_for(tokens, page_size: int):
    """Pages that hold `tokens` tokens of one sequence (ceil(tokens / page_size)); an int, or
    elementwise for a tensor of lengths."""
    return -(-tokens // page_size)


class OutOfPages(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int) -> None:
        if num_pages < 1:
            raise ValueError("the KV cache needs at least one page")
        self.num_pages = num_pages
        # a stack: recently freed pages are reused first, which keeps them warm in caches
        self._free = list(range(num_pages - 1, -1, -1))
        self._out = [False] * num_pages

    @property
    def available(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        for p in pages:
            self._out[p] = True
        return pages

    def free(self, pages: Iterable[int]) -> None:
        for p in pages:
            if not self._out[p]:
                raise RuntimeError(f"page {p} freed twice")
            self._out[p] = False
            self._free.append(p)

"""Pages and slots: handed out once, returned once."""

from __future__ import annotations

import pytest

from minisgl.kvcache import PageAllocator
from minisgl.kvcache.allocator import OutOfPages
from minisgl.scheduler.table import TableManager


def test_pages_are_distinct_and_come_back() -> None:
    alloc = PageAllocator(10)
    a, b = alloc.allocate(4), alloc.allocate(6)
    assert len(set(a + b)) == 10 and alloc.available == 0 and alloc.used == 10
    with pytest.raises(OutOfPages):
        alloc.allocate(1)
    alloc.free(a)
    alloc.free(b)
    assert alloc.used == 0 and alloc.available == 10


def test_double_free_is_refused() -> None:
    alloc = PageAllocator(3)
    pages = alloc.allocate(2)
    alloc.free(pages)
    with pytest.raises(RuntimeError, match="freed twice"):
        alloc.free(pages[:1])
    table = TableManager(2)
    slot = table.allocate()
    table.free(slot)
    with pytest.raises(RuntimeError, match="freed twice"):
        table.free(slot)

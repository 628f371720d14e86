"""Paged KV cache: the page pool (device memory) and the allocator of its pages."""

from __future__ import annotations

from .allocator import PageAllocator, pages_for
from .pool import KVCachePool

__all__ = ["KVCachePool", "PageAllocator", "pages_for"]

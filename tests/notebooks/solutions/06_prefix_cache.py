"""Reference solution of notebook 06's exercise: tokens from the cache on a repeat."""

from __future__ import annotations


def cached_on_repeat(prompt_len: int, page_size: int) -> int:
    # whole pages only, and never the page of the prompt's last token past it: that token
    # is computed again, the step samples from its output
    return (prompt_len - 1) // page_size * page_size

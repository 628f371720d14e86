"""Where a marker may begin at the end of a text: what both parsers hold back.

Contract: `partial_suffix(text, marker)` is the index where the longest end of `text`
that could still begin `marker` starts (`len(text)`: none), so a parser sends the text
before it and keeps the rest until the next piece says whether the marker came.
"""

from __future__ import annotations


def partial_suffix(text: str, marker: str) -> int:
    """Where the longest end of `text` that could begin `marker` starts (len(text): none)."""
    for start in range(max(0, len(text) - len(marker) + 1), len(text)):
        if marker.startswith(text[start:]):
            return start
    return len(text)

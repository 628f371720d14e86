"""What an answer waiting in the API server holds in memory, counted honestly.

Contract: `text_bytes(text)` is the memory one piece of output text takes where it waits
(the str object and its slot in a list), `logprobs_bytes(infos)` that of a list of
`TokenInfo` (each struct, its strings and bytes, its float, its list of alternatives and
theirs). These are what the caps count (--max-pending-bytes for a stream's unread output,
--max-response-bytes for a whole answer collected): the encoded size would undercount the
Python objects by four times or more (a one-character piece is a 50-byte str; a token's
logprobs with five alternatives are over a kilobyte).
"""

from __future__ import annotations

import sys

from minisgl.message import TokenInfo

_SLOT = 8  # a pointer in the list that holds it
_FLOAT = sys.getsizeof(0.5)
_EMPTY = TokenInfo("", b"", 0.0)
_INFO = sys.getsizeof(_EMPTY) + _FLOAT + _SLOT + sys.getsizeof([])  # struct, logprob, top
_TOP = sys.getsizeof(("", b"", 0.0)) + _FLOAT + _SLOT  # one alternative's tuple


def text_bytes(text: str) -> int:
    return sys.getsizeof(text) + _SLOT


def logprobs_bytes(infos: list[TokenInfo]) -> int:
    size = 0
    for i in infos:
        size += _INFO + sys.getsizeof(i.token) + sys.getsizeof(i.raw)
        size += sum(_TOP + sys.getsizeof(t) + sys.getsizeof(r) for t, r, _ in i.top)
    return size

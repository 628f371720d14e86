"""Reference solution of notebook 05's exercise: replies that fit under the cap."""

from __future__ import annotations


def replies_that_fit(cap: int, reply_bytes: int) -> int:
    # the listener aborts once pending_bytes > cap: reaching the cap exactly is fine
    return cap // reply_bytes

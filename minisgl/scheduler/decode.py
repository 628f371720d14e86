"""DecodeManager: requests whose prompt is cached and that produce one token per step.

Contract: `running` holds them (the RUNNING sequences, core.py) in admission order.
`schedule_next(cache, evict)` gives each a page for its next token (except one whose pending
token is its last, see policy.py); when the pool runs dry it preempts the most recently
admitted requests (`evict` frees a victim's pages and slot; the victim is recomputed later)
and returns them, for the policy to mark PREEMPTED and readmit. `abort_req(uid)` removes and returns a running request.
"""

from __future__ import annotations

from collections.abc import Callable

from minisgl.core import Req

from .cache import CacheManager


class DecodeManager:
    def __init__(self) -> None:
        self.running: dict[tuple[int, int], Req] = {}  # (uid, index) -> req, admission order

    def __len__(self) -> int:
        return len(self.running)

    @property
    def runnable(self) -> bool:
        return bool(self.running)

    def add_req(self, req: Req) -> None:
        self.running[req.key] = req

    def remove_req(self, req: Req) -> None:
        self.running.pop(req.key, None)

    def abort_req(self, uid: int, index: int | None = None) -> list[Req]:
        """Remove the request's sequences (one choice, or all when index is None)."""
        keys = [k for k in self.running if k[0] == uid and index in (None, k[1])]
        return [self.running.pop(k) for k in keys]

    def schedule_next(
        self, cache: CacheManager, evict: Callable[[Req], None]
    ) -> tuple[list[Req], list[Req]]:
        """Return (requests decoding this step, requests preempted to make room)."""
        # a sequence whose pending token is its last (by length) has nothing left to run
        # (Req.seq_len inlined: this runs for every request of every step)
        # a constrained sequence waits for its pending token: its next mask depends on it
        reqs = [
            r
            for r in self.running.values()
            if len(r.token_ids) + r.num_pending < r.max_len
            and not (r.num_pending and r.matcher is not None)
        ]
        needs = cache.next_token_pages(reqs)  # 0 or 1 each
        needed = sum(needs)
        preempted: list[Req] = []
        while needed > cache.available and len(reqs) > 1:
            victim = reqs.pop()  # newest first: the oldest requests keep making progress
            needed -= needs.pop()
            del self.running[victim.key]
            evict(victim)
            preempted.append(victim)
        for req, need in zip(reqs, needs):
            if need:
                cache.grow(req, req.cached_len + 1)
            req.extend_len = 1
        return reqs, preempted

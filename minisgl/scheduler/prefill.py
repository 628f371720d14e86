"""PrefillManager: requests whose tokens are not all in the KV cache yet.

Contract: holds admitted-but-not-running sequences: new ones, those whose prompts are being
prefilled chunk by chunk, and preempted or freshly forked ones. `schedule_next(budget, ...)`
picks chunks in `turns` order, as many as fit under the step's `ChunkBudget` (pacing.py),
the free table slots and the free pages, and sets each one's `extend_len`. Two fairness
rules make that order. Clients take turns (a request's `client` is its API key or address):
one client's queued requests do not hold back another's. Within a client, the shortest
remaining goes first (the fewest prompt tokens left to compute; ties in arrival order): a
short prompt that arrives while a long one is being prefilled takes its turn in the next
step, beside the long one's next chunk, instead of waiting for the whole long prompt; the
long one gets whatever budget is left each step, so it still moves on. One preempted while its last sampled token was still on
the device (overlap scheduling) waits until that token is known. With the prefix cache, a
sequence first takes the longest cached prefix of its tokens, and one whose next page
another sequence of the same step computes (the same prefix, arriving together) waits a
step and then finds that page cached. A sequence that asks for prompt logprobs takes no
cached prefix while prompt positions are left to score: a cached page holds K/V but not the
logits the scores come from, so those positions are computed (and their pages still offered
to the cache for others). `abort_req(uid)` removes a request wherever it is in
the queue and returns it (all its choices), so the caller can free the slots and pages a
partial prefill holds.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable

from minisgl.core import Req

from .cache import CacheManager
from .pacing import ChunkBudget
from .table import TableManager


class PrefillManager:
    def __init__(self) -> None:
        self.pending: deque[Req] = deque()

    def __len__(self) -> int:
        return len(self.pending)

    @property
    def runnable(self) -> bool:
        return bool(self.pending)

    def add_req(self, req: Req) -> None:
        self.pending.append(req)

    def readmit(self, reqs: Iterable[Req]) -> None:
        """Preempted or forked sequences go back to the front, in the given order."""
        for req in reversed(list(reqs)):
            self.pending.appendleft(req)

    def remove_req(self, req: Req) -> None:
        if req in self.pending:
            self.pending.remove(req)

    def abort_req(self, uid: int, index: int | None = None) -> list[Req]:
        """Remove the request's sequences (one choice, or all when index is None)."""
        found = [r for r in self.pending if r.uid == uid and index in (None, r.index)]
        for req in found:
            self.pending.remove(req)
        return found

    def schedule_next(
        self,
        budget: ChunkBudget,
        table: TableManager,
        cache: CacheManager,
        keep_free: int,
        running: Iterable[Req] = (),
    ) -> list[Req]:
        """Pick prefill chunks; `keep_free` pages stay free for the `running` sequences to
        grow."""
        chosen: list[Req] = []
        ps = cache.page_size
        for req in turns(self.pending, running):
            if budget.rows_at(req.cached_len) <= 0:
                break
            if req.num_pending:
                continue  # preempted while its last token was on the device: wait for it
            if req.table_idx < 0 and table.available == 0:
                break
            scoring = req.scores_prompt  # prompt logprobs need every position's logits
            if not req.pages and req.cached_len == 0 and not scoring:  # new, or back
                hit = cache.match(req)  # the longest cached prefix is not recomputed
                if len(req.token_ids) == req.prompt_len:  # no token reported yet
                    req.cached_tokens = hit
            if (
                cache.tree is not None
                and not scoring
                and any(_same_next_page(c, req, ps) for c in chosen)
            ):
                # its next page is computed in this step: next step it is cached, and the
                # sequence matches again from scratch, that page included
                cache.release(req)
                req.cached_len = 0
                continue
            # room in the request's last page plus whole free pages it may take
            room = len(req.pages) * ps - req.cached_len + max(0, cache.available - keep_free) * ps
            chunk = min(budget.rows_at(req.cached_len), req.uncached_len, room)
            if chunk <= 0:
                break  # it keeps the matched pages, if any, for when there is room
            if req.table_idx < 0:
                req.table_idx = table.allocate()
                cache.bind(req)  # pages it shares (a cached prefix, its first choice's)
            cache.grow(req, req.cached_len + chunk)
            req.extend_len = chunk
            budget.spend(chunk, req.cached_len)
            chosen.append(req)
            if chunk < req.uncached_len:
                break  # partly prefilled: the budget or the room is spent
        for req in chosen:
            if req.extend_len == req.uncached_len:
                self.pending.remove(req)
        return chosen


def turns(pending: Iterable[Req], running: Iterable[Req]) -> list[Req]:
    """The order in which `pending` sequences get their prefill turn: clients take turns, a
    client's own sequences shortest remaining first. A sequence's place is how many of its
    client's sequences run or come before it; ties go to the shortest remaining, then to
    arrival. So one client's thousand queued requests do not hold back another client's
    first one, and a client that is alone is served shortest first as before."""
    ahead = Counter(req.client for req in running)
    places = []
    # shortest remaining first; sorted() is stable, so ties go by arrival
    for i, req in enumerate(sorted(pending, key=lambda r: r.uncached_len)):
        places.append((ahead[req.client], i, req))
        ahead[req.client] += 1
    return [req for _, _, req in sorted(places, key=lambda p: p[:2])]


def _same_next_page(chosen: Req, req: Req, page_size: int) -> bool:
    """Whether `chosen`'s chunk computes the page `req` needs next, for the same prefix:
    two requests that share a system prompt arrive together, and the second should find
    the first's pages in the cache rather than compute the prompt a second time."""
    end = req.cached_len + page_size  # req's next page: [cached_len, end)
    if end > (len(req.token_ids) - 1) // page_size * page_size:
        return False  # it holds req's last token: req computes it anyway
    start, stop = chosen.cached_len, chosen.cached_len + chosen.extend_len
    return (
        start <= req.cached_len
        and stop >= end
        and chosen.sampling_params.cache_salt == req.sampling_params.cache_salt
        and chosen.token_ids[:end] == req.token_ids[:end]
    )

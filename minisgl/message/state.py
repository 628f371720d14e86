"""The scheduler's answer to a state query, typed: what /debug/lifecycle and /metrics show
of it.

Contract: `Scheduler.state()` builds one `SchedulerState` (the scheduler's counts); the
answer to a `StateQueryMsg` adds `flushed_pages` when the query flushed the prefix cache
and, with tensor parallelism, `ranks`: each rank's own counts as a `RankState` (its rank
and process id first). A field left `UNSET` is not part of the answer: the HTTP edge turns
it into JSON with `msgspec.to_builtins`, which omits it, so the answer's JSON has the
counts in the order declared here, then `flushed_pages` and `ranks` when set.
"""

from __future__ import annotations

import msgspec
from msgspec import UNSET, UnsetType


# kw_only: a subclass's own positional fields come first (RankState's rank and pid)
class SchedulerCounts(msgspec.Struct, kw_only=True):
    """One scheduler's live counts. Those of requests (pending, running, table_slots_used,
    kv_pages_used, grammar_matchers) return to zero when nothing is in flight; the pool's
    size and the prefix cache's counts do not."""

    pending: int  # sequences waiting or partly prefilled (a grammar being built too)
    running: int  # sequences decoding
    table_slots_used: int  # rows of the page table held by live sequences
    kv_pages_used: int  # KV pages held by live requests
    kv_pages_total: int  # the KV pool's size in pages
    kv_pages_cached: int  # pages held by the prefix cache alone
    prefix_cache_nodes: int
    prefix_cache_query_tokens: int  # prompt tokens looked up in the prefix cache, in all
    prefix_cache_hit_tokens: int  # of them, found there
    grammar_matchers: int  # sequences whose output a grammar constrains (one matcher each)
    # pages the query's flush freed (-1: requests were in flight, nothing was flushed)
    flushed_pages: int | UnsetType = UNSET


class RankState(SchedulerCounts):
    """One tensor-parallel rank's counts, with the rank and its process."""

    rank: int
    pid: int


class SchedulerState(SchedulerCounts, kw_only=True):
    # with tensor parallelism, on rank 0's answer: every rank's own counts, rank 0 first
    ranks: list[RankState] | UnsetType = UNSET

    def on_rank(self, rank: int, pid: int) -> RankState:
        """These counts as rank `rank`'s (in process `pid`)."""
        counts = {name: getattr(self, name) for name in SchedulerCounts.__struct_fields__}
        return RankState(rank, pid, **counts)


class Lifecycle(msgspec.Struct):
    """Every process's live per-uid state, as GET /debug/lifecycle answers it (the JSON of
    `msgspec.to_builtins`, which leaves out the scheduler's unset fields)."""

    frontend: dict[str, int]
    tokenizer: dict[str, int]
    scheduler: SchedulerState

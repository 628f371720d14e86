"""Timeline events: what happened to a request in each process, and when.

Contract: a `TimelineEvent` is one thing that happened to one uid in one process
("api", "tokenizer", "scheduler"), at `t` on the machine's monotonic clock (shared by the
three processes), with a few numbers or words of detail; never a prompt or an output. The
workers batch their events into a `TimelineMsg` that rides in a send that goes out anyway
(the scheduler adds its batch at most every few tenths of a second, and when it goes
idle): no message per token, nothing that waits. The scheduler's batch also carries the
token count of each step it ran (`step_tokens`) and a sample of its KV pages (`kv`).

Each process ends a uid's timeline with exactly one end event, its last:
- api: "finished" (reason), "aborted" (by: client_disconnect, slow_client, stall,
  shutdown) or "error" (code);
- tokenizer: "finished", "aborted" (the API server's AbortMsg) or "error" (kind);
- scheduler: "finished" (reason; a stop string's stop too), "aborted" or "error" (kind);
  its end carries the request's queue, prefill and decode times and its preemptions.
"""

from __future__ import annotations

from typing import Any

import msgspec

END_EVENTS = frozenset({"finished", "aborted", "error"})


class TimelineEvent(msgspec.Struct, array_like=True):
    uid: int
    process: str  # "api", "tokenizer" or "scheduler"
    event: str
    t: float  # time.monotonic() when it happened (or began)
    detail: dict[str, Any] | None = None
    t_end: float | None = None  # for a span (decode progress): when it ended


class TimelineMsg(msgspec.Struct, tag=True):
    events: list[TimelineEvent]
    step_tokens: list[int] = []  # tokens computed by each step since the last batch
    kv: tuple[float, int, int, int] | None = None  # (t, pages used, cached, total)

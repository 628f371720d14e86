"""Timeline events: what happened to a request in each process, and when.

Contract: a timeline event is one thing that happened to one uid in one process
("api", "tokenizer", "scheduler"), at `t` on the machine's monotonic clock (shared by the
three processes), with a few numbers or words of detail; never a prompt or an output. Each
kind of event is its own Struct (tagged by the event's name, the `event` field of
GET /debug/requests), so a consumer matches on the type, not on a string. A detail field
left UNSET is absent from the event's JSON; one set to None is there as null. The
workers batch their events into a `TimelineMsg` that rides in a send that goes out anyway
(the scheduler adds its batch at most every few tenths of a second, and when it goes
idle): no message per token, nothing that waits. The scheduler's batch also carries the
token count of each step it ran (`step_tokens`) and a sample of its KV pages (`kv`).

A process records its own events through a `Recorder`: `record(uid, kind, **detail)`
adds an event of that kind, now, and `take()` hands over (and forgets) what it recorded.
The `Recorder` itself records nothing (timelines off: `--debug-history 0`, the offline
API), so a component calls it unconditionally; an `EventLog` keeps them. The scheduler
hands its recorder to its engine, and both call `phase(name)` where a step's time starts
to count toward another phase ("schedule", "prepare", "forward", "sample", "post"): a
no-op here, a lap clock in benchmarks/step_overhead.py.

Each process ends a uid's timeline with exactly one end event (an `End`), its last:
- api: `Finished` (reason), `Aborted` (by: client_disconnect, slow_client, stall,
  shutdown) or `Errored` (code, kind);
- tokenizer: `Finished`, `Aborted` (the API server's AbortMsg) or `Errored` (kind);
- scheduler: `Finished` (reason; a stop string's stop too), `Aborted` or `Errored` (kind);
  its end carries the request's queue, prefill and decode times and its preemptions
  (`End.timed`: all three were measured).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

API = "api"
TOKENIZER = "tokenizer"
SCHEDULER = "scheduler"

_NOT_DETAIL = frozenset({"uid", "process", "t", "t_end"})


class TimelineEvent(msgspec.Struct, tag_field="event"):
    """One event; each kind below is a subclass tagged with the event's name."""

    uid: int
    process: str  # API, TOKENIZER or SCHEDULER
    t: float  # time.monotonic() when it happened (or began)

    @property
    def event(self) -> str:
        """The event's name (its tag), as GET /debug/requests shows it."""
        return self.__struct_config__.tag

    def detail(self) -> dict[str, Any]:
        """The event's own fields that are set, in their order (its JSON detail)."""
        return {
            name: value
            for name in self.__struct_fields__
            if name not in _NOT_DETAIL and (value := getattr(self, name)) is not UNSET
        }


# ---------------------------------------------------------------- the API server's
class Received(TimelineEvent, tag="received"):
    """The HTTP request came in."""


class Admitted(TimelineEvent, tag="admitted"):
    """Its TokenizeMsg went out."""


class FirstOutput(TimelineEvent, tag="first_output"):
    """The first reply with output (API server), or the first output detokenized."""


# ---------------------------------------------------------------- the tokenizer worker's
class Tokenized(TimelineEvent, tag="tokenized"):
    prompt_tokens: int


class Compiled(TimelineEvent, tag="compiled"):
    """The request's grammar is compiled."""


class StopString(TimelineEvent, tag="stop_string"):
    """A stop string ended choice `index`."""

    index: int


# ---------------------------------------------------------------- the scheduler's
class Queued(TimelineEvent, tag="queued"):
    prompt_tokens: int | UnsetType = UNSET  # unset: refused at admission
    n: int | UnsetType = UNSET


class CacheHit(TimelineEvent, tag="cache_hit"):
    """The prefix cache gave the first `tokens` prompt tokens."""

    tokens: int


class Readmitted(TimelineEvent, tag="readmitted"):
    """Prefilled again after a preemption."""


class PrefillChunk(TimelineEvent, tag="prefill"):
    step: int
    tokens: int
    index: int


class FirstToken(TimelineEvent, tag="first_token"):
    pass


class Preempted(TimelineEvent, tag="preempted"):
    index: int


class Decode(TimelineEvent, tag="decode"):
    """A span of decoding: `tokens` output tokens from `t` to `t_end`."""

    tokens: int
    t_end: float | None = None


# ---------------------------------------------------------------- ends (every process)
_TIMING = ("preemptions", "queue_s", "prefill_s", "decode_s")


class End(TimelineEvent):
    """How a process ended a request: the last event of its process. The scheduler's end
    carries the request's times (the others leave them unset)."""

    preemptions: int | UnsetType = UNSET
    queue_s: float | UnsetType = UNSET  # queued to its first prefill chunk
    prefill_s: float | UnsetType = UNSET  # to its first token
    decode_s: float | UnsetType = UNSET  # to its end

    @property
    def timed(self) -> bool:
        """Queue, prefill and decode time were all measured (it got a first token)."""
        return self.decode_s is not UNSET

    def detail(self) -> dict[str, Any]:
        detail = super().detail()
        for name in _TIMING:  # the kind's own fields first, then the times
            if name in detail:
                detail[name] = detail.pop(name)
        return detail


class Finished(End, tag="finished"):
    reason: str | None = None  # the finish reason ("stop" for a stop string too)


class Aborted(End, tag="aborted"):
    by: str | UnsetType = UNSET  # the API server's: who ended it


class Errored(End, tag="error"):
    code: str | UnsetType = UNSET  # the API server's: the OpenAI error code
    kind: str | None | UnsetType = UNSET  # the ErrorKind's value


AnyEvent = (
    Received
    | Admitted
    | FirstOutput
    | Tokenized
    | Compiled
    | StopString
    | Queued
    | CacheHit
    | Readmitted
    | PrefillChunk
    | FirstToken
    | Preempted
    | Decode
    | Finished
    | Aborted
    | Errored
)


class TimelineMsg(msgspec.Struct, tag=True):
    events: list[AnyEvent]
    step_tokens: list[int] = []  # tokens computed by each step since the last batch
    kv: tuple[float, int, int, int] | None = None  # (t, pages used, cached, total)


# the end events' names, for readers of the JSON (GET /debug/requests)
END_EVENTS = frozenset(kind.__struct_config__.tag for kind in (Finished, Aborted, Errored))


class Recorder:
    """Where a component records its own timeline events; this one records nothing."""

    def record(self, uid: int, event: type[TimelineEvent], /, **detail: Any) -> None:
        pass

    def take(self) -> list[AnyEvent]:
        return []

    def phase(self, name: str) -> None:
        """From now on the step's time counts toward phase `name` (see the module)."""


class EventLog(Recorder):
    """Keeps the events of `process`, stamped with `clock()`, until they are taken."""

    def __init__(self, process: str, clock: Callable[[], float] = time.monotonic) -> None:
        self.process = process
        self.clock = clock
        self.events: list[AnyEvent] = []

    def record(self, uid: int, event: type[TimelineEvent], /, **detail: Any) -> None:
        self.events.append(event(uid, self.process, self.clock(), **detail))

    def take(self) -> list[AnyEvent]:
        events, self.events = self.events, []
        return events

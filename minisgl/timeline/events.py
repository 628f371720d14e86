"""Timeline events: what happened to a request in each process, and when.

Contract: a timeline event is one thing that happened to one uid in one process ("api",
"tokenizer", "scheduler"), at `t` on the machine's monotonic clock (shared by the three
processes), with a few numbers or words of detail; never a prompt or an output. Each kind
is its own Struct tagged with the event's name (the `event` field of GET /debug/requests):
a consumer matches on the type, and `KINDS` finds the type from the name an observer hook
was given. A detail field left UNSET is absent from the event's JSON; one set to None is
there as null. The workers batch their events into a `TimelineMsg` that rides in a send
that goes out anyway; the scheduler's batch also carries the token count of each step it
ran (`step_tokens`) and a sample of its KV pages (`kv`).

Each process ends a uid's timeline with exactly one end event (an `End`), its last:
- api: `Finished` (reason), `Aborted` (by: client_disconnect, slow_client, stall,
  shutdown) or `Errored` (code, kind);
- tokenizer: `Finished`, `Aborted` (the API server's AbortMsg) or `Errored` (kind);
- scheduler: `Finished` (reason; a stop string's stop too), `Aborted` or `Errored` (kind);
  its end carries the request's queue, prefill and decode times and its preemptions
  (`End.timed`: all three were measured).
"""

from __future__ import annotations

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


# every event kind by its name, for observers told an event's name (`RequestObserver.event`)
KINDS: dict[str, type[TimelineEvent]] = {
    kind.__struct_config__.tag: kind
    for kind in AnyEvent.__args__  # type: ignore[attr-defined]
}

"""The API server's record of each request's life in all three processes.

Contract: `Timelines` is the store. `start(uid, ...)` opens a request's timeline (with when
the HTTP request came in and when its TokenizeMsg went out); `record(uid, Kind)` adds an
event of the API server; `add(msg)` adds a batch of the workers' events (`TimelineMsg`);
`end(event, ...)` records the API server's end (an `End`) and moves the timeline to the
ring of ended ones, which keeps the last `history` (0: none). Workers' events that come
after the API server's end still join their timeline while it is in the ring; events for a
uid in neither are dropped. Within one process an end event is the last: an event after it
is not recorded but counted (`late_events`), so a test can prove there are none.
Consecutive "decode" spans of one process merge into one. The KV page samples that come
with the scheduler's batches are kept for the last KV_WINDOW_S seconds, at most one a second.

`snapshot(counts, limit, since, request_id, owner)` is the body of GET /debug/requests: at
most `limit` timelines of each list (in flight, ended newest first), only ended ones after
the `since`-th end (each ended timeline carries its `seq`), or only those of one request
id; with `owner`, only the timelines of requests sent with that API key (its digest), and
no KV page samples (they tell other tenants' sizes).
Times are seconds since the request's arrival; prompts and outputs are never recorded.

`ApiTimeline` is the observer (minisgl/observe.py) that fills a store from the
FrontendManager's hooks: the scope's start, the first output, how the request ended, and
the workers' batches that reach the API server.
"""

from __future__ import annotations

import time
from collections import OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from minisgl.message import ErrorKind
from minisgl.observe import Outcome, RequestObserver

from .events import (
    API,
    Aborted,
    Admitted,
    AnyEvent,
    Decode,
    End,
    Errored,
    Finished,
    FirstOutput,
    Received,
    TimelineEvent,
    TimelineMsg,
)

if TYPE_CHECKING:
    from minisgl.server.frontend import RequestState

KV_WINDOW_S = 300.0


@dataclass
class Timeline:
    uid: int
    request_id: str
    endpoint: str
    arrival: float  # time.monotonic() when the HTTP request came in
    owner: str | None = None  # the digest of the API key it came with
    events: list[AnyEvent] = field(default_factory=list)
    ended: set[str] = field(default_factory=set)  # processes whose end is recorded
    prompt_tokens: int = 0
    output_tokens: int = 0
    seq: int = 0  # once ended: how many requests had ended before it, plus one

    def add(self, event: AnyEvent) -> bool:
        """Add `event`; False if its process has already ended this request."""
        if event.process in self.ended:
            return False
        if isinstance(event, Decode):
            last = next((e for e in reversed(self.events) if e.process == event.process), None)
            if isinstance(last, Decode):  # one span of decoding, however many batches
                last.t_end = event.t_end
                last.tokens += event.tokens
                return True
        self.events.append(event)
        if isinstance(event, End):
            self.ended.add(event.process)
        return True

    def state(self) -> str:
        """running, or how the API server ended it (its end event's name)."""
        for event in reversed(self.events):
            if event.process == API and isinstance(event, End):
                return event.event
        return "running"

    def as_dict(self) -> dict[str, Any]:
        events = []
        for e in sorted(self.events, key=lambda e: e.t):
            item: dict[str, Any] = {
                "process": e.process,
                "event": e.event,
                "t": round(e.t - self.arrival, 6),
            }
            if isinstance(e, Decode) and e.t_end is not None:
                item["t_end"] = round(e.t_end - self.arrival, 6)
            item.update(e.detail())
            events.append(item)
        item = {
            "uid": self.uid,
            "request_id": self.request_id,
            "endpoint": self.endpoint,
            "state": self.state(),
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "events": events,
        }
        if self.seq:
            item["seq"] = self.seq
        return item


class Timelines:
    def __init__(self, history: int, clock=time.monotonic) -> None:
        self.history = history
        self.clock = clock
        self.live: dict[int, Timeline] = {}
        self.done: OrderedDict[int, Timeline] = OrderedDict()  # oldest first
        self.kv: deque[tuple[float, int, int, int]] = deque()
        self.late_events = 0  # events after their process's end (there should be none)
        self.ended_count = 0  # requests ended since start (the last `seq`)

    def start(
        self,
        uid: int,
        request_id: str,
        endpoint: str,
        arrival: float,
        admitted: float,
        owner: str | None = None,
    ) -> None:
        """`arrival`: the HTTP request came in; `admitted`: its TokenizeMsg went out;
        `owner`: the digest of its API key."""
        timeline = Timeline(uid, request_id, endpoint, arrival, owner)
        timeline.add(Received(uid, API, arrival))
        timeline.add(Admitted(uid, API, admitted))
        self.live[uid] = timeline

    def _find(self, uid: int) -> Timeline | None:
        return self.live.get(uid) or self.done.get(uid)

    def record(self, uid: int, event: type[TimelineEvent], /, **detail: Any) -> None:
        """An event of the API server itself, now."""
        timeline = self.live.get(uid)
        if timeline is not None:
            timeline.add(event(uid, API, self.clock(), **detail))

    def add(self, msg: TimelineMsg) -> None:
        for event in msg.events:
            timeline = self._find(event.uid)
            if timeline is not None and not timeline.add(event):
                self.late_events += 1
        if msg.kv is not None and (not self.kv or msg.kv[0] - self.kv[-1][0] >= 1.0):
            self.kv.append(msg.kv)
            while self.kv and msg.kv[0] - self.kv[0][0] > KV_WINDOW_S:
                self.kv.popleft()

    def end(self, end: End, prompt_tokens: int, output_tokens: int) -> Timeline | None:
        """The API server's end of a request (an End of process API); its timeline joins
        the ended ones."""
        timeline = self.live.pop(end.uid, None)
        if timeline is None:
            return None
        timeline.prompt_tokens, timeline.output_tokens = prompt_tokens, output_tokens
        timeline.add(end)
        self.ended_count += 1
        timeline.seq = self.ended_count
        if self.history > 0:
            self.done[end.uid] = timeline
            while len(self.done) > self.history:
                self.done.popitem(last=False)
        return timeline

    def snapshot(
        self,
        counts: dict[int, tuple[int, int]],
        limit: int = 100,
        since: int = 0,
        request_id: str | None = None,
        owner: str | None = None,
    ) -> dict[str, Any]:
        """GET /debug/requests: in-flight requests (with their token counts so far, from
        `counts`), ended ones newest first, and the KV page samples; see the module's
        docstring for `limit`, `since` and `request_id`."""
        now = self.clock()

        def wanted(timeline: Timeline) -> bool:
            if owner is not None and timeline.owner != owner:
                return False
            return request_id is None or timeline.request_id == request_id

        in_flight = []
        for uid, timeline in self.live.items():
            if len(in_flight) == limit:
                break
            if not wanted(timeline):
                continue
            timeline.prompt_tokens, timeline.output_tokens = counts.get(uid, (0, 0))
            item = timeline.as_dict()
            item["age"] = round(now - timeline.arrival, 6)
            in_flight.append(item)
        ended = []
        for timeline in reversed(self.done.values()):  # newest first: stop at `since`
            if len(ended) == limit or timeline.seq <= since:
                break
            if wanted(timeline):
                ended.append(timeline.as_dict())
        return {
            "in_flight": in_flight,
            "ended": ended,
            "in_flight_total": sum(map(wanted, self.live.values()))
            if owner is not None
            else len(self.live),
            "ended_total": self.ended_count,  # the newest `seq`: pass it as `since` next
            "history": self.history,
            "late_events": self.late_events,
            # (seconds before now, pages used by live requests, cached-only pages, total)
            "kv_pages": [
                (round(t - now, 3), used, cached, total)
                for t, used, cached, total in (self.kv if owner is None else ())
            ],
        }


class ApiTimeline(RequestObserver):
    """The FrontendManager's hooks, recorded into `store`; `arrival()` is when the HTTP
    request being served came in and its path (None: unknown, as outside a server),
    `owner()` the digest of the API key it came with."""

    def __init__(
        self,
        store: Timelines,
        arrival: Callable[[], tuple[float, str] | None] = lambda: None,
        owner: Callable[[], str | None] = lambda: None,
    ) -> None:
        self.store = store
        self.arrival = arrival
        self.owner = owner

    def received(self, state: RequestState, /, **detail: Any) -> None:
        now = self.store.clock()
        arrival, endpoint = self.arrival() or (now, "-")
        self.store.start(state.uid, state.request_id, endpoint, arrival, now, self.owner())

    def first_output(self, state: RequestState, /) -> None:
        self.store.record(state.uid, FirstOutput)

    def ended(self, state: RequestState, outcome: Outcome, /, code: str = "", **detail) -> None:
        end = end_event(state, outcome, code, self.store.clock())
        self.store.end(end, state.buffer.prompt_tokens, state.buffer.completion_tokens)

    def inbox(self, msg: Any, /) -> bool:
        if not isinstance(msg, TimelineMsg):
            return False
        self.store.add(msg)
        return True


def end_event(state: RequestState, outcome: Outcome, code: str, t: float) -> End:
    """The API server's end of the request's timeline at `t`, from how it ended."""
    uid, error = state.uid, state.buffer.error
    if outcome is Outcome.FINISHED:
        return Finished(uid, API, t, reason=state.buffer.choices[0].finish_reason)
    if outcome is Outcome.ABORTED_CLIENT:
        return Aborted(uid, API, t, by="client_disconnect")
    if outcome is Outcome.ABORTED_SLOW_CLIENT:
        return Aborted(uid, API, t, by="stall" if error is None else "slow_client")
    if error is not None and error.kind is ErrorKind.SHUTTING_DOWN:
        return Aborted(uid, API, t, by="shutdown")
    return Errored(uid, API, t, code=code, kind=error.kind.value if error else None)

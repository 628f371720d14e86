"""SchedulerTimeline: the scheduler's part of every request's timeline.

Contract: the scheduler holds a `SchedulerRecorder`, whose methods do nothing (no
timelines: the offline API, tests), or a `SchedulerTimeline`, and calls it where a request's life changes (queued, each prefill
chunk, first token, preempted, each sequence's end) and once per step with the step's
token count; `due(idle)` says whether a batch should go out now (every FLUSH_S while
busy, at once when the scheduler goes idle), and `flush(running, kv)` returns it as a
`TimelineMsg` (None when there is nothing to say). Nothing here runs per token: decode
progress is counted at flush time, from the running sequences' lengths, as one "decode"
event per request and batch.

A request's end is its last sequence's end (n choices end separately; an aborted first
choice takes the choices it had not forked yet with it). That end event carries the
request's queue time (queued to first prefill chunk), prefill time (to its first token),
decode time (to its end) and preemptions, which the API server turns into metrics.

`detailed=False` (the server's `--debug-history 0`) records only what the metrics need:
queued, first token, preemptions and the end; prefill chunks, decode progress, prefix
cache hits and readmissions are left out.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from minisgl.core import Batch, Req
from minisgl.message import TimelineMsg
from minisgl.message.timeline import (
    SCHEDULER,
    Aborted,
    CacheHit,
    Decode,
    End,
    Errored,
    Finished,
    FirstToken,
    Preempted,
    PrefillChunk,
    Queued,
    Readmitted,
    Recorder,
    TimelineEvent,
)


@dataclass
class _Life:
    live: int  # sequences not yet ended, choices not yet forked included
    queued: float
    first_prefill: float | None = None
    first_token: float | None = None
    preemptions: int = 0
    waiting_readmit: bool = False  # preempted, not prefilled again yet
    reason: str | None = None  # the finish reason of the latest sequence to end
    unreported: int = 0  # decode tokens of ended sequences not in a decode event yet


class SchedulerRecorder(Recorder):
    """The hooks the scheduler calls where a request's life changes, beside the Recorder's
    phase marks of each step; these record nothing (the scheduler's default: no timelines,
    nothing to flush)."""

    def queued(self, uid: int, n: int, prompt_tokens: int) -> None:
        pass

    def rejected(self, uid: int, kind: str) -> None:
        pass

    def errored(self, uid: int, kind: str) -> None:
        pass

    def step(self, batch: Batch, step: int) -> None:
        """A step is launched: its prefill chunks and its token count."""

    def first_tokens(self, reqs: list[Req]) -> None:
        """The sequences that sampled from their prompt in a step that has been read."""

    def preempted(self, reqs: list[Req]) -> None:
        pass

    def ended(self, req: Req, how: str, sequences: int = 1) -> None:
        pass

    def due(self, idle: bool) -> bool:
        """Whether a batch should go out now (see `flush`)."""
        return False

    def flush(self, running: list[Req], kv: tuple[int, int, int]) -> TimelineMsg:
        return TimelineMsg([])


class SchedulerTimeline(SchedulerRecorder):
    FLUSH_S = 0.2

    def __init__(self, detailed: bool = True, clock=time.monotonic) -> None:
        self.detailed = detailed
        self.clock = clock
        self.events: list[TimelineEvent] = []
        self.step_tokens: list[int] = []
        self.lives: dict[int, _Life] = {}
        self._last_flush = clock()

    # ------------------------------------------------------------ a request's life
    def queued(self, uid: int, n: int, prompt_tokens: int) -> None:
        now = self.clock()
        self.lives[uid] = _Life(n, now)
        self.events.append(Queued(uid, SCHEDULER, now, prompt_tokens=prompt_tokens, n=n))

    def rejected(self, uid: int, kind: str) -> None:
        """Refused at admission: queued and ended in one."""
        now = self.clock()
        self.events += [Queued(uid, SCHEDULER, now), Errored(uid, SCHEDULER, now, kind=kind)]

    def errored(self, uid: int, kind: str) -> None:
        """Queued, then refused before its first prefill chunk (its grammar)."""
        if self.lives.pop(uid, None) is not None:
            self.events.append(Errored(uid, SCHEDULER, self.clock(), kind=kind))

    def prefill(self, req: Req, tokens: int, step: int, cached: int) -> None:
        """One prefill chunk of `tokens` tokens, from position `cached`, in step `step`."""
        life = self.lives.get(req.uid)
        if life is None:
            return
        now = self.clock()
        if life.first_prefill is None:
            life.first_prefill = now
            if cached and self.detailed:  # the prefix cache gave the first `cached` tokens
                self.events.append(CacheHit(req.uid, SCHEDULER, now, tokens=cached))
        if life.waiting_readmit:
            life.waiting_readmit = False
            if self.detailed:
                self.events.append(Readmitted(req.uid, SCHEDULER, now))
        if self.detailed:
            chunk = PrefillChunk(req.uid, SCHEDULER, now, step=step, tokens=tokens, index=req.index)
            self.events.append(chunk)

    def step(self, batch: Batch, step: int) -> None:
        tokens = batch.decodes
        for req in batch.reqs[batch.decodes :]:
            tokens += req.extend_len
            self.prefill(req, req.extend_len, step, req.cached_len)
        self.step_tokens.append(tokens)

    def first_tokens(self, reqs: list[Req]) -> None:
        for req in reqs:
            if req.output_len:
                self.first_token(req)

    def first_token(self, req: Req) -> None:
        life = self.lives.get(req.uid)
        if life is not None and life.first_token is None:
            life.first_token = self.clock()
            self.events.append(FirstToken(req.uid, SCHEDULER, life.first_token))

    def preempted(self, reqs: list[Req]) -> None:
        now = self.clock()
        for req in reqs:
            life = self.lives.get(req.uid)
            if life is None:
                continue
            life.preemptions += 1
            life.waiting_readmit = True
            self.events.append(Preempted(req.uid, SCHEDULER, now, index=req.index))

    def ended(self, req: Req, how: str, sequences: int = 1) -> None:
        """`sequences` of `req`'s request ended (`how`: a finish reason, "stop" for a stop
        string, "aborted", or "error"); the last one ends the request."""
        life = self.lives.get(req.uid)
        if life is None:
            return
        life.live -= sequences
        if how not in ("aborted", "error"):
            life.reason = how
        life.unreported += req.output_len - req.reported_len
        req.reported_len = req.output_len
        if life.live > 0:
            return
        del self.lives[req.uid]
        now = self.clock()
        if self.detailed and life.unreported > 0:  # the last tokens, then the end
            start = max(self._last_flush, life.first_token or self._last_flush)
            self.events.append(Decode(req.uid, SCHEDULER, start, life.unreported, now))
        end: End
        if how == "aborted":
            end = Aborted(req.uid, SCHEDULER, now)
        elif how == "error":
            end = Errored(req.uid, SCHEDULER, now)
        else:
            end = Finished(req.uid, SCHEDULER, now, reason=life.reason)
        end.preemptions = life.preemptions
        if life.first_prefill is not None:
            end.queue_s = life.first_prefill - life.queued
            if life.first_token is not None:
                end.prefill_s = life.first_token - life.first_prefill
                end.decode_s = now - life.first_token
        self.events.append(end)

    # ------------------------------------------------------------ batching
    def due(self, idle: bool) -> bool:
        if not (self.events or self.step_tokens):
            return False
        return idle or self.clock() - self._last_flush >= self.FLUSH_S

    def flush(self, running: list[Req], kv: tuple[int, int, int]) -> TimelineMsg:
        """The batch since the last one: events, decode progress, step sizes, KV pages."""
        now = self.clock()
        if self.detailed:
            progress: dict[int, int] = {}
            for req in running:
                new = req.output_len - req.reported_len
                if new > 0:
                    req.reported_len += new
                    progress[req.uid] = progress.get(req.uid, 0) + new
            for uid, tokens in progress.items():
                life = self.lives.get(uid)
                first = life.first_token if life and life.first_token else self._last_flush
                start = max(first, self._last_flush)
                self.events.append(Decode(uid, SCHEDULER, start, tokens, now))
        msg = TimelineMsg(self.events, self.step_tokens, (now, *kv))
        self.events, self.step_tokens, self._last_flush = [], [], now
        return msg

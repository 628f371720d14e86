"""SchedulerTimeline: the scheduler's part of every request's timeline.

Contract: an observer of the Scheduler (minisgl/observe.py). Its hooks record a request's
life: queued (`received`), refused at admission or before its first chunk (`ended` with a
uid), each prefill chunk (`step`, with the step's token count), its first token,
preemptions (`event`), each sequence's end (`ended` with the Req). `outbox(idle)` is the
batch to send on, when `due`: every FLUSH_S while busy, at once when the scheduler goes
idle; `flush(running, kv)` builds it as a `TimelineMsg`, with decode progress counted from
the running sequences' lengths (one "decode" event per request and batch: nothing runs per
token) and the KV pages of `policy`'s cache manager.

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
from typing import Any

from minisgl.core import Batch, Req
from minisgl.observe import RequestObserver

from .events import (
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
    TimelineEvent,
    TimelineMsg,
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


class SchedulerTimeline(RequestObserver):
    FLUSH_S = 0.2

    def __init__(self, policy: Any = None, detailed: bool = True, clock=time.monotonic) -> None:
        self.policy = policy  # whose running sequences and KV pages each batch reports
        self.detailed = detailed
        self.clock = clock
        self.events: list[TimelineEvent] = []
        self.step_tokens: list[int] = []
        self.lives: dict[int, _Life] = {}
        self._last_flush = clock()

    # ------------------------------------------------------------ the scheduler's hooks
    def received(self, uid: int, /, n: int = 1, prompt_tokens: int = 0, **detail: Any) -> None:
        now = self.clock()
        self.lives[uid] = _Life(n, now)
        self.events.append(Queued(uid, SCHEDULER, now, prompt_tokens=prompt_tokens, n=n))

    def ended(self, req: Req | int, how: str, /, sequences: int = 1, kind: str = "") -> None:
        """`sequences` of a Req's request ended (`how`: a finish reason, "stop" for a stop
        string, "aborted", or "error"); the last one ends the request. A uid alone: the
        request was refused (`kind`) at admission, or before its first prefill chunk."""
        if isinstance(req, Req):
            self._sequences_ended(req, how, sequences)
        elif self.lives.pop(req, None) is not None:  # queued, then refused (its grammar)
            self.events.append(Errored(req, SCHEDULER, self.clock(), kind=kind))
        else:  # refused at admission: queued and ended in one
            now = self.clock()
            self.events += [Queued(req, SCHEDULER, now), Errored(req, SCHEDULER, now, kind=kind)]

    def step(self, batch: Batch, number: int, /) -> None:
        tokens = batch.decodes
        for req in batch.reqs[batch.decodes :]:
            tokens += req.extend_len
            self.prefill(req, req.extend_len, number, req.cached_len)
        self.step_tokens.append(tokens)

    def first_output(self, req: Req, /) -> None:
        life = self.lives.get(req.uid)
        if life is not None and life.first_token is None and req.output_len:
            life.first_token = self.clock()
            self.events.append(FirstToken(req.uid, SCHEDULER, life.first_token))

    def event(self, req: Req, name: str, /, **detail: Any) -> None:
        life = self.lives.get(req.uid)
        if name != "preempted" or life is None:
            return
        life.preemptions += 1
        life.waiting_readmit = True
        self.events.append(Preempted(req.uid, SCHEDULER, self.clock(), index=req.index))

    def outbox(self, idle: bool = False, /) -> list[TimelineMsg]:
        if not self.due(idle):
            return []
        cache = self.policy.cache_manager
        running = list(self.policy.decode_manager.running.values())
        return [self.flush(running, (cache.used, cache.cached, cache.total))]

    # ------------------------------------------------------------ a request's life
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

    def _sequences_ended(self, req: Req, how: str, sequences: int) -> None:
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

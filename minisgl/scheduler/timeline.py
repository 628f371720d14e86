"""SchedulerTimeline: the scheduler's part of every request's timeline.

Contract: the scheduler calls it where a request's life changes (queued, each prefill
chunk, first token, preempted, each sequence's end) and once per step with the step's
token count; `due(now, idle)` says whether a batch should go out now (every FLUSH_S while
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

from minisgl.core import Req
from minisgl.message import TimelineEvent, TimelineMsg

SCHEDULER = "scheduler"


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


class SchedulerTimeline:
    FLUSH_S = 0.2

    def __init__(self, detailed: bool = True, clock=time.monotonic) -> None:
        self.detailed = detailed
        self.clock = clock
        self.events: list[TimelineEvent] = []
        self.step_tokens: list[int] = []
        self.lives: dict[int, _Life] = {}
        self._last_flush = clock()

    def _event(self, uid: int, event: str, t: float, **detail) -> None:
        self.events.append(TimelineEvent(uid, SCHEDULER, event, t, detail or None))

    # ------------------------------------------------------------ a request's life
    def queued(self, uid: int, n: int, prompt_tokens: int) -> None:
        now = self.clock()
        self.lives[uid] = _Life(n, now)
        self._event(uid, "queued", now, prompt_tokens=prompt_tokens, n=n)

    def rejected(self, uid: int, kind: str) -> None:
        """Refused at admission: queued and ended in one."""
        now = self.clock()
        self._event(uid, "queued", now)
        self._event(uid, "error", now, kind=kind)

    def errored(self, uid: int, kind: str) -> None:
        """Queued, then refused before its first prefill chunk (its grammar)."""
        if self.lives.pop(uid, None) is not None:
            self._event(uid, "error", self.clock(), kind=kind)

    def prefill(self, req: Req, tokens: int, step: int, cached: int) -> None:
        """One prefill chunk of `tokens` tokens, from position `cached`, in step `step`."""
        life = self.lives.get(req.uid)
        if life is None:
            return
        now = self.clock()
        if life.first_prefill is None:
            life.first_prefill = now
            if cached and self.detailed:  # the prefix cache gave the first `cached` tokens
                self._event(req.uid, "cache_hit", now, tokens=cached)
        if life.waiting_readmit:
            life.waiting_readmit = False
            if self.detailed:
                self._event(req.uid, "readmitted", now)
        if self.detailed:
            self._event(req.uid, "prefill", now, step=step, tokens=tokens, index=req.index)

    def first_token(self, req: Req) -> None:
        life = self.lives.get(req.uid)
        if life is not None and life.first_token is None:
            life.first_token = self.clock()
            self._event(req.uid, "first_token", life.first_token)

    def preempted(self, reqs: list[Req]) -> None:
        now = self.clock()
        for req in reqs:
            life = self.lives.get(req.uid)
            if life is None:
                continue
            life.preemptions += 1
            life.waiting_readmit = True
            self._event(req.uid, "preempted", now, index=req.index)

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
            self._event(req.uid, "decode", start, tokens=life.unreported)
            self.events[-1].t_end = now
        timing = {"preemptions": life.preemptions}
        if life.first_prefill is not None:
            timing["queue_s"] = life.first_prefill - life.queued
            if life.first_token is not None:
                timing["prefill_s"] = life.first_token - life.first_prefill
                timing["decode_s"] = now - life.first_token
        if how in ("aborted", "error"):
            self._event(req.uid, how, now, **timing)
        else:
            self._event(req.uid, "finished", now, reason=life.reason, **timing)

    # ------------------------------------------------------------ batching
    def step(self, tokens: int) -> None:
        self.step_tokens.append(tokens)

    def due(self, now: float, idle: bool) -> bool:
        if not (self.events or self.step_tokens):
            return False
        return idle or now - self._last_flush >= self.FLUSH_S

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
                self._event(uid, "decode", max(first, self._last_flush), tokens=tokens)
                self.events[-1].t_end = now
        msg = TimelineMsg(self.events, self.step_tokens, (now, *kv))
        self.events, self.step_tokens, self._last_flush = [], [], now
        return msg

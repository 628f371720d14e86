"""The tokenizer worker's part of every request's timeline.

Contract: `TokenizerTimeline` observes a TokenizerWorker (minisgl/observe.py). With `record`
(the server's --debug-history > 0) its hooks become events of process "tokenizer": the
prompt tokenized (received), the first output detokenized, a grammar compiled, a stop
string, and the request's end (finished, aborted by the API server, or an error). Either
way it takes the scheduler's `TimelineMsg` batches that reach the worker and passes them on
in its own batch (`outbox`), after its events until then, so the API server sees every
process's events in the order they were recorded here.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from minisgl.observe import RequestObserver

from .events import (
    KINDS,
    TOKENIZER,
    Aborted,
    Errored,
    Finished,
    FirstOutput,
    TimelineMsg,
    Tokenized,
)

_ENDS = {"finished": Finished, "aborted": Aborted, "error": Errored}


class TokenizerTimeline(RequestObserver):
    def __init__(self, record: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.record = record
        self.clock = clock
        self.batch = TimelineMsg([])  # what goes out with the worker's next send

    def _add(self, uid: int, event: type, /, **detail: Any) -> None:
        if self.record:
            self.batch.events.append(event(uid, TOKENIZER, self.clock(), **detail))

    def received(self, uid: int, /, **detail: Any) -> None:
        self._add(uid, Tokenized, **detail)

    def first_output(self, uid: int, /) -> None:
        self._add(uid, FirstOutput)

    def event(self, uid: int, name: str, /, **detail: Any) -> None:
        self._add(uid, KINDS[name], **detail)

    def ended(self, uid: int, outcome: str, /, **detail: Any) -> None:
        self._add(uid, _ENDS[outcome], **detail)

    def inbox(self, msg: Any, /) -> bool:
        if not isinstance(msg, TimelineMsg):
            return False
        self.batch.events += msg.events
        self.batch.step_tokens += msg.step_tokens
        self.batch.kv = msg.kv or self.batch.kv
        return True

    def outbox(self, idle: bool = False, /) -> list[TimelineMsg]:
        batch = self.batch
        if not (batch.events or batch.step_tokens or batch.kv):
            return []
        self.batch = TimelineMsg([])
        return [batch]

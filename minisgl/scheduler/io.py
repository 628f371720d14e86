"""The scheduler's I/O over ZMQ: what the process loop (`Scheduler.run_forever`) receives
from the tokenizer worker and sends back.

Contract: `ZmqSchedulerIO` implements the scheduler's I/O seam (`receive`, `send`); tests
drive the same `Scheduler` with in-memory I/O instead. While idle, `receive` waits for
work but notices an orphaned process: it raises `ParentGone` once the launcher is gone.
`send_last` sends and waits (a little) for delivery: the process exits next. The process
itself (building the engine, the loop under the worker harness) is
minisgl/server/workers.py's `scheduler_worker`.
"""

from __future__ import annotations

from minisgl.message import BackendMsg, TokenizerMsg
from minisgl.utils.worker import ParentWatch
from minisgl.utils.zmq import PullQueue, PushQueue


class ParentGone(Exception):
    pass


class ZmqSchedulerIO:
    def __init__(self, inbox: PullQueue, outbox: PushQueue, parent: ParentWatch) -> None:
        self.inbox, self.outbox, self.parent = inbox, outbox, parent

    def receive(self, blocking: bool) -> list[BackendMsg]:
        if not blocking:
            return self.inbox.get(timeout_ms=0)
        while True:  # idle: wait for work, but notice an orphaned process
            msgs = self.inbox.get(timeout_ms=500)
            if msgs:
                return msgs
            if not self.parent.alive():
                raise ParentGone

    def send(self, replies: list[TokenizerMsg]) -> None:
        self.outbox.put(replies)

    def send_last(self, replies: list[TokenizerMsg]) -> None:
        """Send, then wait (a little) until ZMQ has delivered: the process exits next."""
        self.outbox.put(replies)
        self.outbox.close(linger_ms=2000)

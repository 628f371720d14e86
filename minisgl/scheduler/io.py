"""The scheduler process: the engine and the scheduler loop behind ZMQ.

Contract: `ZmqSchedulerIO` is the process's implementation of the scheduler's I/O seam
(`receive`, `send`); tests drive the same `Scheduler` with in-memory I/O instead.
`scheduler_worker` builds the engine, reports readiness (or why it could not start) to the
launcher, and runs the loop until told to exit or until its parent process disappears.
"""

from __future__ import annotations

import logging
import os
from multiprocessing.connection import Connection

from minisgl.message import BackendMsg, TokenizerMsg
from minisgl.utils.process import configure_worker_logging, parent_alive
from minisgl.utils.zmq import PullQueue, PushQueue

logger = logging.getLogger(__name__)


class ParentGone(Exception):
    pass


class ZmqSchedulerIO:
    def __init__(self, inbox: PullQueue, outbox: PushQueue, parent_pid: int) -> None:
        self.inbox, self.outbox, self.parent_pid = inbox, outbox, parent_pid

    def receive(self, blocking: bool) -> list[BackendMsg]:
        if not blocking:
            return self.inbox.get(timeout_ms=0)
        while True:  # idle: wait for work, but notice an orphaned process
            msgs = self.inbox.get(timeout_ms=500)
            if msgs:
                return msgs
            if not parent_alive(self.parent_pid):
                raise ParentGone

    def send(self, replies: list[TokenizerMsg]) -> None:
        self.outbox.put(replies)


def scheduler_worker(args, model_dir, channels, ready: Connection) -> None:
    """Process entry point."""
    import torch

    from minisgl.engine.engine import Engine

    from .scheduler import Scheduler

    configure_worker_logging("scheduler", args.log_level)
    try:
        config = args.engine_config()
        config.model = str(model_dir)
        engine = Engine(config)
        scheduler = Scheduler(engine, max_prefill_tokens=args.max_prefill_tokens)
        io = ZmqSchedulerIO(
            PullQueue(channels.scheduler, BackendMsg),
            PushQueue(channels.tokenizer, TokenizerMsg),
            os.getppid(),
        )
    except Exception as exc:
        logger.exception("scheduler failed to start")
        ready.send(("error", f"scheduler failed to start: {exc}"))
        raise SystemExit(1) from exc
    ready.send(("ready", {"max_seq_len": engine.max_seq_len, "kv_pages_total": engine.num_pages}))
    try:
        with torch.inference_mode():
            scheduler.run_forever(io)
    except ParentGone:
        logger.warning("the launcher is gone: scheduler exits")

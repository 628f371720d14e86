"""The scheduler process: the engine and the scheduler loop behind ZMQ.

Contract: `ZmqSchedulerIO` is the process's implementation of the scheduler's I/O seam
(`receive`, `send`); tests drive the same `Scheduler` with in-memory I/O instead.
`scheduler_worker` builds the engine and runs the loop under the worker harness
(utils/worker.py: readiness, or why it could not start, reported to the launcher), until
the launcher terminates the process or the process sees its parent gone (`receive` raises
`ParentGone` then).
With tensor parallelism it is rank 0: it joins the ranks' process group first, and its
scheduler's calls, with what they received, are broadcast to the other ranks, which make
the same calls (ranks.py; their processes: minisgl/distributed_worker.py). A rank
that dies or stops makes a collective fail within --dist-timeout seconds: every request in
flight is then answered with an error, and the process exits (status 1) so that the
launcher stops the server, whose ranks can no longer compute together.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
from multiprocessing.connection import Connection

from minisgl.message import BackendMsg, TokenizerMsg
from minisgl.utils.worker import ParentWatch, Serving, run_worker
from minisgl.utils.zmq import PullQueue, PushQueue

logger = logging.getLogger(__name__)


class ParentGone(Exception):
    pass


def share_cpu_cores(device: str) -> None:
    """On a CPU the API server and the tokenizer worker need cores too: torch's compute
    threads spin-wait on each other, and one descheduled thread stalls them all (a 1500-token
    stream took 57 s instead of 1.3 s on two cores). Leave two cores to the other processes.
    This is where a process starts; a single-rank engine then widens a step to every core
    where that measures faster (minisgl.engine.threads)."""
    import torch

    from minisgl.engine.threads import narrow_threads
    from minisgl.utils.process import usable_cores

    if device == "cuda" or (device == "auto" and torch.cuda.is_available()):
        return
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(narrow_threads(usable_cores()))


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


def scheduler_worker(args, model_dir, channels, ready: Connection, heartbeat=None) -> None:
    """Process entry point (the start-up protocol: utils/worker.py)."""

    def build(parent: ParentWatch) -> Serving:
        from minisgl.engine.engine import Engine

        from .scheduler import Scheduler
        from .timeline import SchedulerTimeline

        share_cpu_cores(args.engine_config.device)
        config = dataclasses.replace(args.engine_config, model=str(model_dir))
        if config.tp_size > 1:  # rank 0 of the tensor-parallel ranks: it decides for all
            from minisgl.distributed import init_tp

            device = config.resolve_device().type
            init_tp(0, config.tp_size, args.dist_init_method, device, config.dist_timeout)
        engine = Engine(config)
        timeline = SchedulerTimeline(detailed=args.debug_history > 0)
        scheduler = Scheduler(engine, args.scheduler_config, timeline)
        scheduler.grammars.warm()  # the token table, before the first constrained request
        io = ZmqSchedulerIO(
            PullQueue(channels.scheduler, BackendMsg),
            PushQueue(channels.tokenizer, TokenizerMsg),
            parent,
        )
        info = {
            "max_seq_len": engine.max_seq_len,
            "kv_pages_total": engine.num_pages,
            "degraded": engine.degraded,  # the parts the self-check fell back from
        }
        return Serving(functools.partial(_serve, scheduler, io, config.dist_timeout), info)

    run_worker("scheduler", "scheduler", args.log_level, build, ready, heartbeat)


def _serve(scheduler, io: ZmqSchedulerIO, dist_timeout: float) -> None:
    import torch

    from minisgl.distributed import RanksFailed
    from minisgl.message import ErrorInfo, ErrorKind

    try:
        with torch.inference_mode():
            scheduler.run_forever(io)
    except ParentGone:
        logger.warning("the launcher is gone: scheduler exits")
    except RanksFailed as exc:  # a rank died or stopped mid-step: the ranks are out of step
        message = (
            f"a tensor-parallel rank did not answer within {dist_timeout:g} s "
            f"(--dist-timeout): {exc}"
        )
        logger.error("%s; the scheduler stops", message)
        error = ErrorInfo(ErrorKind.BACKEND_UNAVAILABLE, message)
        io.send_last(scheduler.fail_all(error))
        raise SystemExit(1) from None

"""The two worker processes the supervisor starts beside the API server: where each worker's
core (the scheduler, the tokenizer worker) is built, given its seams, and served.

Contract: `scheduler_worker` and `tokenize_worker` are process entry points that follow the
start-up protocol of utils/worker.py (readiness, or why the worker could not start,
reported to the launcher over `ready`). Each builds its core, registers its observers
(the timelines, minisgl/timeline/) and attaches its extensions, then serves until the
launcher terminates the process or the process sees its parent gone.
- The scheduler: the engine built and vetted (engine/build.py) and the scheduler loop
  behind ZMQ (scheduler/io.py). With tensor parallelism it is rank 0: it joins the ranks'
  process group first (its followers: minisgl/distributed_worker.py). A rank that dies or
  stops makes a collective fail within --dist-timeout seconds: every request in flight is
  then answered with an error, and the process exits (status 1) so that the launcher stops
  the server.
- The tokenizer worker: the tokenizer, its worker, and the worker's preparation of
  prompts (tokenizer/prepare.py) with the grammar-compile processes.

The channels carry the core's messages (minisgl/message/) and the timeline batches the
observers send on (`WIRE`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from multiprocessing.connection import Connection
from pathlib import Path

from minisgl.message import BackendMsg, FrontendMsg, TokenizerMsg
from minisgl.timeline.events import TimelineMsg
from minisgl.utils.worker import ParentWatch, Serving, run_worker

logger = logging.getLogger(__name__)

# what each inbox decodes: the core's messages and the observers' batches
TOKENIZER_WIRE = TokenizerMsg | TimelineMsg
FRONTEND_WIRE = FrontendMsg | TimelineMsg


def scheduler_worker(args, model_dir, channels, ready: Connection, heartbeat=None) -> None:
    """The scheduler process (rank 0 with tensor parallelism)."""

    def build(parent: ParentWatch) -> Serving:
        from minisgl.engine.build import build_engine
        from minisgl.engine.threads import share_cpu_cores
        from minisgl.scheduler import Scheduler
        from minisgl.scheduler.io import ZmqSchedulerIO
        from minisgl.timeline.scheduler import SchedulerTimeline
        from minisgl.utils.zmq import PullQueue, PushQueue

        share_cpu_cores(args.engine_config.device)
        config = dataclasses.replace(args.engine_config, model=str(model_dir))
        if config.tp_size > 1:  # rank 0 of the tensor-parallel ranks: it decides for all
            from minisgl.distributed import init_tp

            device = config.resolve_device().type
            init_tp(0, config.tp_size, args.dist_init_method, device, config.dist_timeout)
        engine = build_engine(config)
        scheduler = Scheduler(engine, args.scheduler_config)
        scheduler.observe(SchedulerTimeline(scheduler.policy, detailed=args.debug_history > 0))
        scheduler.grammars.warm()  # the token table, before the first constrained request
        io = ZmqSchedulerIO(
            PullQueue(channels.scheduler, BackendMsg),
            PushQueue(channels.tokenizer, TOKENIZER_WIRE),
            parent,
        )
        info = {
            "max_seq_len": engine.max_seq_len,
            "kv_pages_total": engine.num_pages,
            "degraded": engine.degraded,  # the parts the self-check fell back from
        }
        return Serving(functools.partial(_serve, scheduler, io, config.dist_timeout), info)

    run_worker(
        "scheduler", "scheduler", args.log_level, build, ready, heartbeat,
        on_orphaned=channels.remove,  # the launcher died: nobody else removes it
    )  # fmt: skip


def _serve(scheduler, io, dist_timeout: float) -> None:
    import torch

    from minisgl.distributed import RanksFailed
    from minisgl.message import ErrorInfo, ErrorKind
    from minisgl.scheduler.io import ParentGone

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


def tokenize_worker(args, model_dir: Path, channels, ready: Connection, heartbeat=None) -> None:
    """The tokenizer worker process."""

    def build(parent: ParentWatch) -> Serving:
        from minisgl.grammar import TokenTable
        from minisgl.grammar.pool import GrammarCompiler
        from minisgl.models.config import ModelConfig
        from minisgl.timeline.tokenizer import TokenizerTimeline
        from minisgl.tokenizer.prepare import Preparation
        from minisgl.tokenizer.server import TokenizerWorker
        from minisgl.tokenizer.tokenize import load_tokenizer
        from minisgl.utils.zmq import PullQueue, PushQueue

        tokenizer = load_tokenizer(model_dir, args.chat_template)
        if tokenizer is None:
            raise RuntimeError(f"{model_dir} has no tokenizer: the server needs one")
        model = ModelConfig.from_dir(model_dir)
        table = TokenTable.of(tokenizer, model.vocab_size)
        # the engine's context is at most this (it may be less: the KV pool bounds it too)
        context = min(
            args.engine_config.max_seq_len or model.max_position_embeddings,
            model.max_position_embeddings,
        )
        inbox = PullQueue(channels.tokenizer, TOKENIZER_WIRE)
        to_scheduler = PushQueue(channels.scheduler, BackendMsg)
        to_api = PushQueue(channels.frontend, FRONTEND_WIRE)
        prepare = Preparation(
            tokenizer,
            GrammarCompiler(table, timeout=args.grammar_compile_timeout),
            grammar_max_bytes=args.grammar_max_bytes,
            max_seq_len=context,
            escape_special=args.escape_special_tokens,
            strict_max_tokens=True,  # past the context left: a 400 (offline: cut)
        )
        worker = TokenizerWorker(tokenizer, to_scheduler.put, to_api.put, prepare)
        worker.observe(TokenizerTimeline(record=args.debug_history > 0))

        def serve() -> None:
            try:
                while True:
                    msgs = inbox.get(timeout_ms=worker.wait_ms(500), wake_on=worker.fds())
                    worker.handle(msgs)  # with nothing received, it collects compiled grammars
                    if not msgs and not parent.alive():
                        return
            finally:
                prepare.close()

        return Serving(serve)

    run_worker(
        "tokenizer", "tokenizer worker", args.log_level, build, ready, heartbeat,
        on_orphaned=channels.remove,
    )  # fmt: skip

"""Launch: start the workers under the supervisor, build the frontend, then serve HTTP (or
the interactive shell, or, on a machine other than node 0, only its tensor-parallel ranks).

Contract:
- The model folder is resolved once (by the supervisor: hub download or default-model
  conversion), so the workers start from a local folder.
- Traffic is accepted only after every worker reported ready; a worker that fails to start
  stops the launch with its reason and exit status 1.
- How the server stops (SIGTERM drains, SIGINT aborts, a second signal stops at once), what
  a dead or silent worker does to requests and to /health, and the removal of the IPC
  directory are the supervisor's (supervisor.py); /health's answer is health.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from typing import TYPE_CHECKING

import uvicorn

from minisgl.message import TokenizerMsg
from minisgl.models.default_model import DEFAULT_MODEL_NAME
from minisgl.utils.process import freeze_startup_objects
from minisgl.utils.zmq import AsyncPullQueue, IpcChannels, PushQueue

from .args import ServerArgs
from .connections import default_max_connections, guarded, quiet_accept_errors
from .frontend import FrontendManager
from .supervisor import Supervisor, WorkerStartError, local_ranks
from .workers import FRONTEND_WIRE

if TYPE_CHECKING:
    from .quiz_pieces import QuizPieces

logger = logging.getLogger(__name__)


def served_model_name(args: ServerArgs) -> str:
    return args.engine_config.model or DEFAULT_MODEL_NAME


class SupervisedServer(uvicorn.Server):
    """Uvicorn, with its signal handling and the workers' watch left to the supervisor."""

    def __init__(self, config: uvicorn.Config, supervisor: Supervisor) -> None:
        super().__init__(config)
        self.supervisor = supervisor

    @contextlib.contextmanager
    def capture_signals(self):
        quiet_accept_errors(asyncio.get_running_loop())  # out of descriptors: one line per 10 s
        with self.supervisor.attached():
            yield


def connect_frontend(
    channels: IpcChannels,
    args: ServerArgs,
    supervisor: Supervisor | None = None,
    pieces: QuizPieces | None = None,
) -> FrontendManager:
    """A FrontendManager wired to the tokenizer worker; with a `supervisor`, it refuses
    requests while a worker is silent; with `pieces`, it runs the quiz's (quiz_pieces.py)."""
    to_tokenizer = PushQueue(channels.tokenizer, TokenizerMsg)
    inbox = AsyncPullQueue(channels.frontend, FRONTEND_WIRE)
    return (pieces.frontend if pieces is not None else FrontendManager)(
        to_tokenizer.put,
        inbox.get,
        max_pending_bytes=args.max_pending_bytes,
        max_response_bytes=args.max_response_bytes,
        report_cached_tokens=not args.hide_cached_tokens,
        max_concurrent=args.max_concurrent_requests,
        worker_fault=supervisor.silent_worker if supervisor is not None else None,
    )


def launch_ranks(args: ServerArgs) -> int:
    """A machine other than node 0 (--node-rank > 0): its tensor-parallel ranks only, until
    one of them exits (node 0 stopped, or a rank died) or this launcher gets a signal."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with Supervisor(args).running() as supervisor:
            logger.info("node %d: ranks %s ready", args.node_rank, local_ranks(args))
            while not stop.wait(0.5):
                dead = supervisor.dead()
                if dead:
                    return 0 if all(w.process.exitcode == 0 for w in dead) else 1
            return 0
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1


def launch_server(args: ServerArgs) -> int:
    from .api_server import create_app
    from .quiz_pieces import from_environment

    if args.node_rank > 0:  # node 0 serves; the others only run their ranks
        return launch_ranks(args)
    pieces = from_environment()  # a learner's quiz code in place of ours (quiz_pieces.py)
    try:
        with Supervisor(args).running() as supervisor:
            frontend = connect_frontend(supervisor.channels, args, supervisor, pieces)
            # the parts of the CUDA fast path the engine's self-check fell back from
            degraded = supervisor.degraded
            app = create_app(
                args,
                served_model_name(args),
                frontend,
                max_model_len=supervisor.scheduler_info.get("max_seq_len"),
                degraded=degraded,
            )
            if pieces is not None:
                pieces.install(app)
            config = uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                timeout_graceful_shutdown=3,  # after our own drain only idle connections remain
                # slow clients are cut off, and open connections bounded (connections.py)
                http=guarded(
                    args.request_read_timeout, args.max_connections or default_max_connections()
                ),
            )
            fell_back = f" (degraded: fell back from {', '.join(degraded)})" if degraded else ""
            logger.info(
                "serving %s on http://%s:%d%s",
                served_model_name(args),
                args.host,
                args.port,
                fell_back,
            )
            freeze_startup_objects()  # the app and its imports: out of the collector's walks
            return supervisor.serve(SupervisedServer(config, supervisor), frontend)
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1

"""Launch: start the scheduler and tokenizer worker processes, wait until both are ready,
then serve HTTP; on exit leave no process and no socket behind.

Contract:
- The model folder is resolved once here (hub download or default-model conversion), so
  the workers start from a local folder.
- Traffic is accepted only after every worker reported ready; a worker that fails to start
  stops the launch with its reason and exit status 1.
- SIGTERM drains: new requests and /health get 503, in-flight requests have
  --shutdown-timeout seconds to finish, the rest end with an error reply; exit status 0.
  SIGINT (Ctrl-C) does the same without waiting. A second signal stops at once, and one
  while the workers are being stopped kills them rather than the launcher.
- A worker that dies while serving: every in-flight request ends with an error reply at
  once (its process sentinel wakes the event loop), /health and new requests answer 503,
  and the server exits with status 1 after a log line naming the dead worker.
- Whatever the path, both workers are stopped and the 0700 IPC directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import uvicorn

from minisgl.message import ErrorInfo, ErrorKind, FrontendMsg, TokenizerMsg
from minisgl.models.default_model import DEFAULT_MODEL_NAME
from minisgl.models.source import resolve_model_dir
from minisgl.utils.heartbeat import new_heartbeat
from minisgl.utils.process import free_port
from minisgl.utils.zmq import AsyncPullQueue, IpcChannels, PushQueue

from .args import ServerArgs
from .connections import default_max_connections, guarded, quiet_accept_errors
from .errors import unavailable
from .frontend import FrontendManager
from .metrics import ServerMetrics
from .timelines import Timelines

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
FAILED_EXIT_DELAY_S = 2.0  # after a worker died: seconds of 503 answers before exiting


class WorkerStartError(RuntimeError):
    pass


def served_model_name(args: ServerArgs) -> str:
    return args.engine_config.model or DEFAULT_MODEL_NAME


def start_workers(
    args: ServerArgs, model_dir: Path, channels: IpcChannels
) -> dict[str, BaseProcess]:
    from minisgl.distributed_worker import rank_worker
    from minisgl.scheduler.io import scheduler_worker
    from minisgl.tokenizer.server import tokenize_worker

    ctx = mp.get_context("spawn")  # fork is unsafe with CUDA and with threads
    procs: dict[str, BaseProcess] = {}
    pipes: dict[str, Connection] = {}
    args = dataclasses.replace(args, dist_init_method=_dist_init_method(args))
    workers = [(f"rank-{r}", rank_worker, (args, model_dir, r)) for r in _local_ranks(args)]
    if args.node_rank == 0:  # node 0 serves: the scheduler (rank 0) and the tokenizer
        workers = [
            ("scheduler", scheduler_worker, (args, model_dir, channels)),
            ("tokenizer", tokenize_worker, (args, model_dir, channels)),
            *workers,
        ]
    for name, target, target_args in workers:
        recv, send = ctx.Pipe(duplex=False)
        heartbeat = new_heartbeat(ctx)
        proc = ctx.Process(
            target=target,
            args=(*target_args, send, heartbeat),
            name=f"minisgl-{name}",
            daemon=True,
        )
        proc.start()
        proc.heartbeat = heartbeat  # type: ignore[attr-defined]  # read by /health
        procs[name], pipes[name] = proc, recv
    try:
        _wait_ready(procs, pipes)
    except BaseException:
        stop_workers(procs)
        raise
    return procs


def _local_ranks(args: ServerArgs) -> list[int]:
    """The tensor-parallel ranks other than 0 that this machine runs."""
    per_node = args.engine_config.tp_size // args.nnodes
    first = args.node_rank * per_node
    return [r for r in range(first, first + per_node) if r != 0]


def _dist_init_method(args: ServerArgs) -> str | None:
    """Where the ranks meet: a free local port, or across machines MASTER_ADDR and
    MASTER_PORT (torch.distributed's standard environment)."""
    if args.engine_config.tp_size == 1:
        return None
    if args.nnodes == 1:
        return f"tcp://127.0.0.1:{free_port()}"
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise WorkerStartError(f"--nnodes > 1 needs {' and '.join(missing)} (node 0's address)")
    return "env://"


def _wait_ready(procs: dict[str, BaseProcess], pipes: dict[str, Connection]) -> None:
    waiting = dict(pipes)
    while waiting:
        sentinels = {procs[n].sentinel: n for n in waiting}
        ready = wait([*waiting.values(), *sentinels], timeout=STARTUP_TIMEOUT_S)
        if not ready:
            raise WorkerStartError(
                f"workers not ready after {STARTUP_TIMEOUT_S:.0f} s: {list(waiting)}"
            )
        for obj in ready:
            name = sentinels.get(obj) if isinstance(obj, int) else None
            if name is not None and not waiting[name].poll():
                raise WorkerStartError(f"the {name} process exited during start-up")
        for name, conn in list(waiting.items()):
            if conn.poll():
                status, info = conn.recv()
                if status != "ready":
                    raise WorkerStartError(info)
                logger.info("%s ready %s", name, info or "")
                procs[name].ready_info = info or {}  # type: ignore[attr-defined]  # card, degraded
                del waiting[name]


def stop_workers(procs: dict[str, BaseProcess], timeout: float = 5.0) -> None:
    for proc in procs.values():
        if proc.is_alive():
            proc.terminate()
    for proc in procs.values():
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()


class Supervisor:
    """How the serving process ends: drained on SIGTERM, aborted on SIGINT, failed when a
    worker dies. Owns the uvicorn server's exit flags and the launcher's exit status.
    (Process shutdown only: each request's own lifecycle is the FrontendManager's.)"""

    def __init__(self, server: uvicorn.Server, app, shutdown_timeout: float) -> None:
        self.server, self.app, self.shutdown_timeout = server, app, shutdown_timeout
        self.exit_code = 0
        self.stopping = False

    @property
    def frontend(self) -> FrontendManager:
        return self.app.state.frontend

    # --8<-- [start:drain]
    def on_signal(self, sig: signal.Signals) -> None:
        if self.stopping:  # a second signal: stop now
            self.server.force_exit = self.server.should_exit = True
            return
        self.stopping = True
        # SIGTERM (an orchestrator) drains; SIGINT (Ctrl-C, a person) aborts at once
        timeout = self.shutdown_timeout if sig == signal.SIGTERM else 0.0
        asyncio.get_running_loop().create_task(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        frontend = self.frontend
        frontend.draining = True  # new requests and /health: 503
        logger.info(
            "stopping: %d request(s) in flight, %.0f s to finish", len(frontend.states), timeout
        )
        if not await frontend.wait_idle(timeout):
            logger.warning("aborting %d request(s) still in flight", len(frontend.states))
            frontend.end_all(ErrorInfo(ErrorKind.SHUTTING_DOWN, "the server is shutting down"))
            await frontend.wait_idle(2.0)  # let their error replies reach the clients
        self.server.should_exit = True

    # --8<-- [end:drain]

    def watch_workers(self, procs: dict[str, BaseProcess]) -> None:
        """A dead worker ends every in-flight request with an error at once (its sentinel
        wakes the loop), then the server exits with status 1."""
        loop = asyncio.get_running_loop()

        def on_exit(name: str, proc: BaseProcess) -> None:
            loop.remove_reader(proc.sentinel)
            proc.join(timeout=1.0)  # reap it, so that its exit code is known
            message = f"the {name} process died (exit code {proc.exitcode}); the server stops"
            logger.error(message)
            self.frontend.fail_all(unavailable(message))
            self.exit_code = 1
            self.stopping = True
            loop.create_task(self._exit_after_errors_sent())

        for name, proc in procs.items():
            loop.add_reader(proc.sentinel, on_exit, name, proc)
        self.frontend.heartbeats = {name: proc.heartbeat for name, proc in procs.items()}

    async def _exit_after_errors_sent(self) -> None:
        # keep answering 503 for a moment, so health checks and clients learn why
        started = asyncio.get_running_loop().time()
        await self.frontend.wait_idle(FAILED_EXIT_DELAY_S)
        await asyncio.sleep(
            max(0.0, started + FAILED_EXIT_DELAY_S - asyncio.get_running_loop().time())
        )
        self.server.should_exit = True


class _Server(uvicorn.Server):
    supervisor: Supervisor

    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn's own handlers re-raise SIGTERM after shutdown, which would kill the
        # process before the workers are stopped and the IPC directory is removed
        loop = asyncio.get_running_loop()
        quiet_accept_errors(loop)  # out of descriptors: one line per 10 s, not a flood
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.supervisor.on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
                # until the workers are stopped (running_workers), a signal must not kill
                # the launcher: that would orphan them and leave the IPC directory behind
                signal.signal(sig, _stopping_already)


@contextlib.contextmanager
def running_workers(args: ServerArgs) -> Iterator[tuple[IpcChannels, dict[str, BaseProcess]]]:
    """Both workers started and ready; on leaving, both stopped and the IPC dir removed."""
    model_dir = resolve_model_dir(args.engine_config.model)
    channels = IpcChannels.create()
    procs: dict[str, BaseProcess] = {}
    try:
        procs = start_workers(args, model_dir, channels)
        yield channels, procs
    finally:
        with _hurried_by_signals(procs):
            stop_workers(procs)
            channels.remove()


def _stopping_already(signum, frame) -> None:
    logger.warning("%s: already stopping", signal.Signals(signum).name)


@contextlib.contextmanager
def _hurried_by_signals(procs: dict[str, BaseProcess]) -> Iterator[None]:
    """While the workers are being stopped (a hung one takes seconds), SIGTERM or SIGINT
    kills those still alive at once instead of killing the launcher, which would leave them
    orphaned and the IPC directory behind."""

    def hurry(signum, frame) -> None:
        logger.warning("%s while stopping: killing the workers now", signal.Signals(signum).name)
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = {sig: signal.signal(sig, hurry) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def connect_frontend(
    channels: IpcChannels, args: ServerArgs, metrics: ServerMetrics | None = None
) -> FrontendManager:
    """A FrontendManager wired to the tokenizer worker; call it inside the event loop."""
    to_tokenizer = PushQueue(channels.tokenizer, TokenizerMsg)
    inbox = AsyncPullQueue(channels.frontend, FrontendMsg)
    return FrontendManager(
        to_tokenizer.put,
        inbox.get,
        max_pending_bytes=args.max_pending_bytes,
        max_response_bytes=args.max_response_bytes,
        report_cached_tokens=not args.hide_cached_tokens,
        max_concurrent=args.max_concurrent_requests,
        metrics=metrics,
        timelines=Timelines(args.debug_history),
        heartbeat_timeout=args.worker_heartbeat_timeout,
    )


def launch_ranks(args: ServerArgs) -> int:
    """A machine other than node 0 (--node-rank > 0): its tensor-parallel ranks only, until
    one of them exits (node 0 stopped, or a rank died) or this launcher gets a signal."""
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        with running_workers(args) as (_, procs):
            logger.info("node %d: ranks %s ready", args.node_rank, _local_ranks(args))
            while not stop.wait(0.5):
                dead = [p for p in procs.values() if not p.is_alive()]
                if dead:
                    return 0 if all(p.exitcode == 0 for p in dead) else 1
            return 0
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1


def launch_server(args: ServerArgs) -> int:
    from .api_server import create_app

    if args.node_rank > 0:  # node 0 serves; the others only run their ranks
        return launch_ranks(args)
    try:
        with running_workers(args) as (channels, procs):
            supervisor: Supervisor | None = None
            # the parts of the CUDA fast path the engine's self-check fell back from
            degraded = procs["scheduler"].ready_info.get("degraded") or {}
            app = create_app(
                args,
                served_model_name(args),
                lambda metrics: connect_frontend(channels, args, metrics),
                lambda frontend: supervisor.watch_workers(procs),
                max_model_len=procs["scheduler"].ready_info.get("max_seq_len"),
                degraded=degraded,
            )
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
            server = _Server(config)
            supervisor = server.supervisor = Supervisor(server, app, args.shutdown_timeout)
            fell_back = f" (degraded: fell back from {', '.join(degraded)})" if degraded else ""
            logger.info(
                "serving %s on http://%s:%d%s",
                served_model_name(args),
                args.host,
                args.port,
                fell_back,
            )
            server.run()
            return supervisor.exit_code
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1

"""Launch: start the scheduler and tokenizer worker processes, wait until both are ready,
then serve HTTP; on exit leave no process and no socket behind.

Contract:
- The model folder is resolved once here (hub download or default-model conversion), so
  the workers start from a local folder.
- Traffic is accepted only after every worker reported ready; a worker that fails to start
  stops the launch with its reason and exit status 1.
- SIGTERM drains: new requests and /health get 503, in-flight requests have
  --shutdown-timeout seconds to finish, the rest end with an error reply; exit status 0.
  SIGINT (Ctrl-C) does the same without waiting. A second signal stops at once.
- A worker that dies while serving: every in-flight request ends with an error reply at
  once (its process sentinel wakes the event loop), /health and new requests answer 503,
  and the server exits with status 1 after a log line naming the dead worker.
- Whatever the path, both workers are stopped and the 0700 IPC directory is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
import sys
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import uvicorn

from minisgl.message import ErrorInfo, ErrorKind, FrontendMsg, TokenizerMsg
from minisgl.models.default_model import DEFAULT_MODEL_NAME
from minisgl.models.source import resolve_model_dir
from minisgl.utils.zmq import AsyncPullQueue, IpcChannels, PushQueue

from .args import ServerArgs
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
    from minisgl.scheduler.io import scheduler_worker
    from minisgl.tokenizer.server import tokenize_worker

    ctx = mp.get_context("spawn")  # fork is unsafe with CUDA and with threads
    procs: dict[str, BaseProcess] = {}
    pipes: dict[str, Connection] = {}
    for name, target in (("scheduler", scheduler_worker), ("tokenizer", tokenize_worker)):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=target,
            args=(args, model_dir, channels, send),
            name=f"minisgl-{name}",
            daemon=True,
        )
        proc.start()
        procs[name], pipes[name] = proc, recv
    try:
        _wait_ready(procs, pipes)
    except BaseException:
        stop_workers(procs)
        raise
    return procs


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
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.supervisor.on_signal, sig)
        try:
            yield
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)


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
        stop_workers(procs)
        channels.remove()


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
        max_concurrent=args.max_concurrent_requests,
        metrics=metrics,
        timelines=Timelines(args.debug_history),
    )


def launch_server(args: ServerArgs) -> int:
    from .api_server import create_app

    try:
        with running_workers(args) as (channels, procs):
            supervisor: Supervisor | None = None
            app = create_app(
                args,
                served_model_name(args),
                lambda metrics: connect_frontend(channels, args, metrics),
                lambda frontend: supervisor.watch_workers(procs),
            )
            config = uvicorn.Config(
                app,
                host=args.host,
                port=args.port,
                log_level=args.log_level,
                timeout_graceful_shutdown=3,  # after our own drain only idle connections remain
            )
            server = _Server(config)
            supervisor = server.supervisor = Supervisor(server, app, args.shutdown_timeout)
            logger.info("serving %s on http://%s:%d", served_model_name(args), args.host, args.port)
            server.run()
            return supervisor.exit_code
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1


def launch_shell(args: ServerArgs) -> int:
    from minisgl.shell import run_shell

    async def main(channels: IpcChannels, procs: dict[str, BaseProcess]) -> int:
        loop = asyncio.get_running_loop()
        shell = loop.create_task(run_shell(connect_frontend(channels, args), args.max_tokens))

        def on_exit(name: str, proc: BaseProcess) -> None:
            loop.remove_reader(proc.sentinel)
            proc.join(timeout=1.0)
            print(f"\nthe {name} process died (exit code {proc.exitcode})", file=sys.stderr)
            shell.cancel()

        for name, proc in procs.items():
            loop.add_reader(proc.sentinel, on_exit, name, proc)
        try:
            return await shell
        except asyncio.CancelledError:
            return 1

    try:
        with running_workers(args) as (channels, procs):
            return asyncio.run(main(channels, procs))
    except WorkerStartError as exc:
        logger.error("%s", exc)
        return 1

"""Launch: start the scheduler and tokenizer worker processes, wait until both are ready,
then serve HTTP; on exit leave no process and no socket behind.

Contract:
- The model folder is resolved once here (hub download or default-model conversion), so
  the workers start from a local folder.
- Traffic is accepted only after every worker reported ready; a worker that fails to start
  stops the launch with its reason and exit status 1.
- SIGINT or SIGTERM stops uvicorn, then both workers; the 0700 IPC directory is removed.
- A worker that dies while serving: every in-flight request ends with an error reply at
  once (its process sentinel wakes the event loop), /health and new requests answer 503.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing as mp
import signal
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path

import uvicorn

from minisgl.message import ErrorInfo, FrontendMsg, TokenizerMsg
from minisgl.models.source import resolve_model_dir
from minisgl.utils.zmq import AsyncPullQueue, IpcChannels, PushQueue

from .args import ServerArgs
from .frontend import FrontendManager

logger = logging.getLogger(__name__)

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
STARTUP_TIMEOUT_S = 600.0


class WorkerStartError(RuntimeError):
    pass


def served_model_name(args: ServerArgs) -> str:
    return args.model or DEFAULT_MODEL_NAME


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


def watch_workers(procs: dict[str, BaseProcess], frontend: FrontendManager) -> None:
    """End every in-flight request when a worker dies; its sentinel wakes the loop."""
    loop = asyncio.get_running_loop()

    def on_exit(name: str, proc: BaseProcess) -> None:
        loop.remove_reader(proc.sentinel)
        message = f"the {name} process died (exit code {proc.exitcode}); the server cannot serve"
        logger.error(message)
        frontend.fail_all(ErrorInfo(message, 503, code="backend_unavailable", type="server_error"))

    for name, proc in procs.items():
        loop.add_reader(proc.sentinel, on_exit, name, proc)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # uvicorn re-raises SIGTERM after its shutdown, which kills the process before the
        # launcher stops the workers and removes the IPC directory: handle it here instead
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def launch_server(args: ServerArgs) -> int:

    from .api_server import create_app

    model_dir = resolve_model_dir(args.model)
    channels = IpcChannels.create()
    procs: dict[str, BaseProcess] = {}
    try:
        try:
            procs = start_workers(args, model_dir, channels)
        except WorkerStartError as exc:
            logger.error("%s", exc)
            return 1

        def connect() -> FrontendManager:
            to_tokenizer = PushQueue(channels.tokenizer, TokenizerMsg)
            inbox = AsyncPullQueue(channels.frontend, FrontendMsg)
            return FrontendManager(to_tokenizer.put, inbox.get, args.max_pending_bytes)

        app = create_app(
            args, served_model_name(args), connect, lambda fe: watch_workers(procs, fe)
        )
        config = uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.log_level,
            timeout_graceful_shutdown=5,
        )
        logger.info("serving %s on http://%s:%d", served_model_name(args), args.host, args.port)
        _Server(config).run()
        return 0
    finally:
        stop_workers(procs)
        channels.remove()

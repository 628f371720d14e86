"""The supervisor: the one owner of the worker processes, of how they start, how the serving
process stops, and what happens when a worker dies or falls silent.

Contract:
- `Supervisor(args).running()` starts the workers of this machine (the scheduler, the
  tokenizer worker and the local tensor-parallel ranks, each under the worker harness of
  utils/worker.py), each with its ready pipe and heartbeat, and returns once every one
  reported ready; a worker that fails to start raises `WorkerStartError` with its reason.
  Whatever the path, on leaving every worker is stopped and the 0700 IPC directory removed;
  a SIGTERM or SIGINT meanwhile kills the workers still alive rather than the launcher
  (`_hurried_by_signals`).
- Serving (`serve`): the frontend is built first and handed over with the uvicorn server.
  SIGTERM drains (new requests and /health get 503, in-flight requests have
  --shutdown-timeout seconds to finish, the rest end with an error reply; exit status 0),
  SIGINT does the same without waiting, a second signal stops at once.
- Watching: a worker that dies ends every in-flight request with `backend_unavailable` at
  once (its process sentinel wakes the event loop), new requests and /health answer 503,
  and the server exits with status 1 after a log line naming the dead worker. A worker
  silent past --worker-heartbeat-timeout (`silent_worker`) makes new requests and /health
  answer 503 until it beats again (the frontend asks it at admission).
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
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from minisgl.message import ErrorInfo, ErrorKind
from minisgl.models.source import resolve_model_dir
from minisgl.utils.heartbeat import new_heartbeat, silent_for
from minisgl.utils.process import free_port
from minisgl.utils.zmq import IpcChannels

from .args import ServerArgs
from .errors import unavailable
from .frontend import FrontendManager

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0
FAILED_EXIT_DELAY_S = 2.0  # after a worker died: seconds of 503 answers before exiting


class WorkerStartError(RuntimeError):
    pass


@dataclass
class Worker:
    """One worker process, the launcher's end of its ready pipe, its heartbeat, and what it
    said when it became ready (the scheduler: its context length and what it fell back
    from)."""

    name: str
    process: BaseProcess
    ready: Connection
    heartbeat: Any  # a shared double (utils/heartbeat.py)
    info: dict[str, Any] = field(default_factory=dict)


class Supervisor:
    def __init__(self, args: ServerArgs) -> None:
        self.args = args
        self.channels: IpcChannels | None = None
        self.workers: dict[str, Worker] = {}
        self.exit_code = 0
        self.stopping = False
        self._server = None  # the uvicorn server, while serving
        self._frontend: FrontendManager | None = None

    # ------------------------------------------------------------------ the workers
    @contextlib.contextmanager
    def running(self) -> Iterator[Supervisor]:
        """Every worker started and ready; on leaving, all stopped and the IPC dir removed."""
        model_dir = resolve_model_dir(self.args.engine_config.model)
        self.channels = IpcChannels.create()
        try:
            self._start(model_dir)
            self._wait_ready()
            yield self
        finally:
            with _hurried_by_signals(self.workers):
                self._stop()
                self.channels.remove()

    def _start(self, model_dir: Path) -> None:
        from minisgl.distributed_worker import rank_worker

        from .workers import scheduler_worker, tokenize_worker

        ctx = mp.get_context("spawn")  # fork is unsafe with CUDA and with threads
        args = dataclasses.replace(self.args, dist_init_method=_dist_init_method(self.args))
        workers = [(f"rank-{r}", rank_worker, (args, model_dir, r)) for r in local_ranks(args)]
        if args.node_rank == 0:  # node 0 serves: the scheduler (rank 0) and the tokenizer
            workers = [
                ("scheduler", scheduler_worker, (args, model_dir, self.channels)),
                ("tokenizer", tokenize_worker, (args, model_dir, self.channels)),
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
            self.workers[name] = Worker(name, proc, recv, heartbeat)

    def _wait_ready(self) -> None:
        waiting = {name: w.ready for name, w in self.workers.items()}
        while waiting:
            sentinels = {self.workers[n].process.sentinel: n for n in waiting}
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
                    self.workers[name].info = info or {}
                    del waiting[name]

    def _stop(self, timeout: float = 5.0) -> None:
        procs = [w.process for w in self.workers.values()]
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
        for proc in procs:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()

    @property
    def scheduler_info(self) -> dict[str, Any]:
        """What the scheduler said when ready: `max_seq_len`, `kv_pages_total`, `degraded`."""
        worker = self.workers.get("scheduler")
        return worker.info if worker is not None else {}

    @property
    def degraded(self) -> dict[str, str]:
        """Each part of the CUDA fast path the engine's self-check fell back from, and why."""
        return self.scheduler_info.get("degraded") or {}

    def dead(self) -> list[Worker]:
        return [w for w in self.workers.values() if not w.process.is_alive()]

    def silent_worker(self) -> ErrorInfo | None:
        """A worker process that has missed its heartbeat for too long (/health's 503)."""
        now = time.monotonic()
        for worker in self.workers.values():
            silent = silent_for(worker.heartbeat, now)
            if silent > self.args.worker_heartbeat_timeout:
                return unavailable(
                    f"the {worker.name} process has not answered for {silent:.1f} s "
                    f"(stopped or hung); requests may not be served"
                )
        return None

    def watch(self, on_exit: Callable[[Worker], None]) -> None:
        """From inside the event loop: call `on_exit(worker)` as soon as a worker exits (its
        process sentinel wakes the loop), once the process is reaped."""
        loop = asyncio.get_running_loop()

        def exited(worker: Worker) -> None:
            loop.remove_reader(worker.process.sentinel)
            worker.process.join(timeout=1.0)  # reap it, so that its exit code is known
            on_exit(worker)

        for worker in self.workers.values():
            loop.add_reader(worker.process.sentinel, exited, worker)

    # ------------------------------------------------------------------ serving
    def serve(self, server, frontend: FrontendManager) -> int:
        """Run the uvicorn `server` (a `SupervisedServer`) in front of `frontend`; the exit
        status."""
        self._server, self._frontend = server, frontend
        server.run()
        return self.exit_code

    @contextlib.contextmanager
    def attached(self) -> Iterator[None]:
        """While the server's loop runs: its SIGTERM/SIGINT handling and the watch of the
        workers. Uvicorn's own handlers re-raise SIGTERM after shutdown, which would kill
        the process before the workers are stopped and the IPC directory is removed."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self.on_signal, sig)
        self.watch(self._worker_died)
        try:
            yield
        finally:
            for worker in self.workers.values():
                loop.remove_reader(worker.process.sentinel)
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
                # until the workers are stopped (`running`), a signal must not kill the
                # launcher: that would orphan them and leave the IPC directory behind
                signal.signal(sig, _stopping_already)

    # --8<-- [start:drain]
    def on_signal(self, sig: signal.Signals) -> None:
        if self.stopping:  # a second signal: stop now
            self._server.force_exit = self._server.should_exit = True
            return
        self.stopping = True
        # SIGTERM (an orchestrator) drains; SIGINT (Ctrl-C, a person) aborts at once
        timeout = self.args.shutdown_timeout if sig == signal.SIGTERM else 0.0
        asyncio.get_running_loop().create_task(self._drain(timeout))

    async def _drain(self, timeout: float) -> None:
        frontend = self._frontend
        frontend.draining = True  # new requests and /health: 503
        logger.info(
            "stopping: %d request(s) in flight, %.0f s to finish", len(frontend.states), timeout
        )
        if not await wait_idle(frontend, timeout):
            logger.warning("aborting %d request(s) still in flight", len(frontend.states))
            end_all(frontend, ErrorInfo(ErrorKind.SHUTTING_DOWN, "the server is shutting down"))
            await wait_idle(frontend, 2.0)  # let their error replies reach the clients
        self._server.should_exit = True

    # --8<-- [end:drain]

    def _worker_died(self, worker: Worker) -> None:
        """Every in-flight request ends with an error at once; the server exits with 1."""
        message = (
            f"the {worker.name} process died (exit code {worker.process.exitcode}); "
            "the server stops"
        )
        logger.error(message)
        self._frontend.fail_all(unavailable(message))
        self.exit_code = 1
        self.stopping = True
        asyncio.get_running_loop().create_task(self._exit_after_errors_sent())

    async def _exit_after_errors_sent(self) -> None:
        # keep answering 503 for a moment, so health checks and clients learn why
        loop = asyncio.get_running_loop()
        started = loop.time()
        await wait_idle(self._frontend, FAILED_EXIT_DELAY_S)
        await asyncio.sleep(max(0.0, started + FAILED_EXIT_DELAY_S - loop.time()))
        self._server.should_exit = True


def local_ranks(args: ServerArgs) -> list[int]:
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


def _stopping_already(signum, frame) -> None:
    logger.warning("%s: already stopping", signal.Signals(signum).name)


@contextlib.contextmanager
def _hurried_by_signals(workers: dict[str, Worker]) -> Iterator[None]:
    """While the workers are being stopped (a hung one takes seconds), SIGTERM or SIGINT
    kills those still alive at once instead of killing the launcher, which would leave them
    orphaned and the IPC directory behind."""

    def hurry(signum, frame) -> None:
        logger.warning("%s while stopping: killing the workers now", signal.Signals(signum).name)
        for worker in workers.values():
            if worker.process.is_alive():
                worker.process.kill()

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers belong to the main thread
        return
    previous = {sig: signal.signal(sig, hurry) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def end_all(frontend: FrontendManager, error: ErrorInfo) -> None:
    """End every in-flight request with `error` (shutdown); the backend drops them."""
    for state in list(frontend.states.values()):
        frontend.end_with_error(state, error)


async def wait_idle(frontend: FrontendManager, timeout: float) -> bool:
    """Wait until no request is in flight; False if some still are after `timeout`."""
    deadline = asyncio.get_running_loop().time() + timeout
    while frontend.states:
        if asyncio.get_running_loop().time() >= deadline:
            return False
        await asyncio.sleep(0.05)
    return True

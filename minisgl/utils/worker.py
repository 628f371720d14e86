"""The start-up protocol every worker process follows, written once.

Contract: a worker's entry point calls `run_worker(name, role, log_level, build, ready,
heartbeat)`. The harness sets up the process's logging (lines tagged `[name]`, Ctrl-C left
to the launcher), starts the heartbeat (utils/heartbeat.py), and calls `build(parent)`,
which builds everything the worker needs and returns a `Serving`: the serve loop and the
information the launcher is told with "ready". What `build` made is then frozen out of the
garbage collector's walks (`freeze_startup_objects`) before the loop starts. If `build`
raises, the launcher receives `("error", "<role> failed to start: <reason>")` over the
`ready` pipe and the process exits with status 1; otherwise it receives `("ready", info)`
and the serve loop runs.

`parent` (a `ParentWatch`) is how a worker notices that its launcher is gone (even killed by
SIGKILL: the worker is then re-parented). A loop that wakes up regularly asks
`parent.alive()` and returns when idle; whatever the worker is doing (a long step of
requests nobody will read, a rank blocked in a collective), a watchdog thread ends it
within WATCH_S of the launcher's death, after `on_orphaned` (the server's workers remove
the IPC directory the launcher can no longer remove).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

from .heartbeat import start_beating
from .process import configure_worker_logging, freeze_startup_objects

logger = logging.getLogger(__name__)

WATCH_S = 0.5  # how often the watchdog thread looks at the parent


class ParentWatch:
    """The process that started this one, as it was when the worker began."""

    def __init__(self) -> None:
        self.pid = os.getppid()

    def alive(self) -> bool:
        """False once the launcher died (even by SIGKILL): this process was re-parented."""
        return os.getppid() == self.pid

    def exit_with_parent(self, on_orphaned: Callable[[], None] | None = None) -> None:
        """From a daemon thread: exit (status 1) within WATCH_S of the parent's death, even
        while the main thread is busy or blocked where it notices nothing; `on_orphaned`
        runs first."""

        def watch() -> None:
            while True:
                time.sleep(WATCH_S)
                if not self.alive():
                    logger.warning("the launcher is gone: exiting")
                    try:
                        if on_orphaned is not None:
                            on_orphaned()
                    finally:
                        os._exit(1)

        threading.Thread(target=watch, name="parent-watch", daemon=True).start()


@dataclass
class Serving:
    """What a worker's `build` returns: its serve loop, and what "ready" tells the launcher."""

    loop: Callable[[], None]
    info: dict[str, Any] = field(default_factory=dict)


def run_worker(
    name: str,
    role: str,
    log_level: str,
    build: Callable[[ParentWatch], Serving],
    ready: Connection,
    heartbeat=None,
    *,
    on_orphaned: Callable[[], None] | None = None,
) -> None:
    """Run one worker process: `name` tags its log lines, `role` names it in the start-up
    error ("scheduler", "tokenizer worker", "rank 1")."""
    configure_worker_logging(name, log_level)
    start_beating(heartbeat)
    parent = ParentWatch()
    parent.exit_with_parent(on_orphaned)
    try:
        serving = build(parent)
    except Exception as exc:
        logger.exception("%s failed to start", role)
        ready.send(("error", f"{role} failed to start: {exc}"))
        raise SystemExit(1) from exc
    freeze_startup_objects()
    ready.send(("ready", serving.info))
    serving.loop()

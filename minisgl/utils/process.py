"""Helpers for the worker processes: logging set-up and noticing an orphaned worker."""

from __future__ import annotations

import logging
import os
import signal


def configure_worker_logging(name: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{name}] %(name)s %(levelname)s %(message)s",
    )
    # Ctrl-C goes to the whole process group: the launcher decides how workers stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def parent_alive(parent_pid: int) -> bool:
    """A worker whose launcher died (even by SIGKILL) is re-parented: then it must exit."""
    return os.getppid() == parent_pid

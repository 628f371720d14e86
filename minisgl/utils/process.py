"""Process and machine helpers: worker logging set-up, noticing an orphaned worker, and
how much memory the machine has available."""

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


def available_ram() -> int:
    """Bytes of memory available to new allocations (MemAvailable on Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")

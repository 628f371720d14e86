"""Process and machine helpers: worker logging set-up, how much memory the machine has
available, and a free local port."""

from __future__ import annotations

import logging
import os
import signal
import socket


def configure_worker_logging(name: str, level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format=f"%(asctime)s [{name}] %(name)s %(levelname)s %(message)s",
    )
    # Ctrl-C goes to the whole process group: the launcher decides how workers stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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

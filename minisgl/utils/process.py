"""Process and machine helpers: worker logging set-up, the collector told to leave what was
built at start-up alone, how much memory the machine has available, how many cores this
process may run on, and a free local port."""

from __future__ import annotations

import gc
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


def freeze_startup_objects() -> None:
    """Move every object alive now out of the cyclic collector's reach, once a process has
    built what it serves with. A model, its tokenizer and their imports are some 360,000
    objects that live until exit; a full collection walks them all (a stall of a sizeable
    part of a second in the middle of a stream: benchmarks/RESULTS.md), and the young collections that serving triggers
    pay for them too. Garbage made afterwards is collected as before."""
    gc.collect()
    gc.freeze()


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


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

"""Process and machine helpers: worker logging set-up, the collector told to leave what was
built at start-up alone, how much memory the machine has available, how many cores this
process may run on, and a free local port."""

from __future__ import annotations

import gc
import logging
import os
import re
import signal
import socket
import subprocess


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
    """Bytes of memory available to new allocations: MemAvailable on Linux; on macOS (no
    /proc, and no SC_AVPHYS_PAGES) the free, inactive and speculative pages `vm_stat`
    reports, which the kernel hands out without swapping; elsewhere the free pages."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    if "SC_AVPHYS_PAGES" in os.sysconf_names:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
    out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=10).stdout
    return vm_stat_available(out)


def vm_stat_available(out: str) -> int:
    """Bytes free, inactive or speculative in macOS `vm_stat` output."""
    page = int(re.search(r"page size of (\d+) bytes", out).group(1))
    kinds = ("Pages free", "Pages inactive", "Pages speculative")
    pages = re.findall(rf"^({'|'.join(kinds)}):\s+(\d+)\.", out, re.MULTILINE)
    if not pages:
        raise RuntimeError(f"cannot read the memory available from vm_stat: {out[:200]!r}")
    return page * sum(int(n) for _, n in pages)

"""Worker heartbeats: a frozen or hung worker process shows as unhealthy.

Contract: the launcher gives each worker process a shared double (`new_heartbeat`); the
worker calls `start_beating(value)` first thing, and a daemon thread of its own writes
`time.monotonic()` into it twice a second for the process's life. The API server reads
the values (`silent_for`): a process that is stopped (SIGSTOP), swapped out or wedged in
native code stops beating, and /health answers 503 once it has been silent for
`--worker-heartbeat-timeout` seconds, until it beats again. No message travels: the check
costs the workers nothing and works while they are busy with a long step. (A worker whose
Python main loop is stuck while its threads still run is not caught this way; its
requests still end through their own timeouts and the lifecycle contract.)
"""

from __future__ import annotations

import threading
import time

BEAT_S = 0.5


def new_heartbeat(ctx):
    """A shared double for one worker, created by the launcher (`ctx`: its mp context)."""
    return ctx.Value("d", time.monotonic(), lock=False)


def start_beating(value) -> None:
    if value is None:
        return

    def beat() -> None:
        while True:
            value.value = time.monotonic()
            time.sleep(BEAT_S)

    threading.Thread(target=beat, name="heartbeat", daemon=True).start()


def silent_for(value, now: float | None = None) -> float:
    """Seconds since the worker's last beat."""
    return (time.monotonic() if now is None else now) - value.value

"""The scheduler: prefill and decode managers, request slots and KV pages, one step loop.

config.py (SchedulerConfig, no torch import), policy.py (Policy: admission, aborts,
preemption, what each step runs, each sequence's status), scheduler.py (Scheduler: the step
loop, the overlap pipeline, the process loop), ranks.py (Ranks: tensor parallelism at the
I/O seam), io.py (the scheduler process). `Scheduler` and `SchedulerIO` are imported on
first use, so that the API server process, which reads the configuration and starts the
scheduler process but never runs the model, does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .scheduler import Scheduler, SchedulerIO

__all__ = ["Scheduler", "SchedulerIO"]


def __getattr__(name: str):
    if name in __all__:
        from . import scheduler

        return getattr(scheduler, name)
    raise AttributeError(f"module 'minisgl.scheduler' has no attribute {name!r}")

"""The scheduler: prefill and decode managers, request slots and KV pages, one step loop."""

from __future__ import annotations

from .scheduler import Scheduler, SchedulerIO

__all__ = ["Scheduler", "SchedulerIO"]

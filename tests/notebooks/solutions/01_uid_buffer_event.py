"""Reference solution of notebook 01's exercise: end a request that waits for ever."""

from __future__ import annotations

import asyncio


async def end_the_stuck_request(task: asyncio.Task) -> None:
    task.cancel()  # a request to cancel: the task unwinds at its next step
    await asyncio.gather(task, return_exceptions=True)  # its scope has exited by now

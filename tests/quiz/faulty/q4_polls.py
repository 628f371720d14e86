"""FAULTY (quiz question 4): a consumer that polls every 10 ms.

It naps on a timer and then looks: less CPU than spinning, but it wakes for nothing a
hundred times a second, and a reply waits up to 10 ms before anyone takes it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        await asyncio.sleep(0.01)
        if not state.event.is_set():
            continue
        state.event.clear()
        output = state.buffer.take()
        yield output
        if output.finished:
            return

"""FAULTY (quiz question 4): take, let the loop run, then clear.

A reply that arrives during the `await` sets the event, and the `clear()` right after
erases that set: the reply waits in the buffer and nothing wakes the consumer again.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        await state.event.wait()
        output = state.buffer.take()
        await asyncio.sleep(0)
        state.event.clear()
        yield output
        if output.finished:
            return

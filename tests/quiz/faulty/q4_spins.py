"""FAULTY (quiz question 4): a consumer that spins on the event loop.

It never waits on the event: it looks at the buffer, yields to the loop with
`asyncio.sleep(0)` and looks again, thousands of times a second while nothing arrives.
Nothing is lost, but a hundred idle requests keep the loop busy for nothing.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        while not state.event.is_set():
            await asyncio.sleep(0)
        state.event.clear()
        output = state.buffer.take()
        yield output
        if output.finished:
            return

"""Reference solution of exercise q4: the consumer loop of one request.

Contract: `wait_for_ack(state)` yields the request's outputs until the terminal one, then
ends. Each output is everything that was pending at one wake-up (`state.buffer.take()`),
so any number of replies between two wake-ups come out together. No wake-up is ever lost:
a reply that arrives while the consumer is away (between two outputs) wakes it again, and
with nothing pending the loop really waits.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    while True:
        await state.event.wait()
        # clear, then take, with no await in between: the listener cannot run between the
        # two lines, so every reply is either in this take or sets the event again after it
        state.event.clear()
        output = state.buffer.take()
        yield output
        if output.finished:
            return

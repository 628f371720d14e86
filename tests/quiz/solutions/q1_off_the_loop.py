"""Reference solution of exercise q1: a blocking call in an async route, off the event loop.

Contract: `await generate_off_the_loop(generate, prompt)` returns `generate(prompt)`. While
the synchronous `generate` runs (it holds its thread, like model compute would), the event
loop keeps running every other coroutine, so other connections are served meanwhile. An
exception raised by `generate` reaches the caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


async def generate_off_the_loop(generate: Callable[[str], str], prompt: str) -> str:
    # The loop's thread only awaits: the compute runs on a worker thread, and the await
    # hands the loop back to everyone else until its result is in. minisgl goes further:
    # tokenizing and the forward pass run in other processes, so its routes only await.
    return await asyncio.to_thread(generate, prompt)

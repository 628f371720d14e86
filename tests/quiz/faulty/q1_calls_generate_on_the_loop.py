"""FAULTY (quiz question 1): the synchronous call made right inside the coroutine.

`async def` alone moves nothing off the event loop: while `generate` runs, no other
coroutine takes a step, and every other connection waits.
"""

from __future__ import annotations

from collections.abc import Callable


async def generate_off_the_loop(generate: Callable[[str], str], prompt: str) -> str:
    return generate(prompt)

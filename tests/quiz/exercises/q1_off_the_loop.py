"""Exercise q1 (quiz question 1): a blocking call must not block the event loop.

Task: `generate(prompt)` is a plain, synchronous function that holds its thread for a
while, the way model compute would. Write `generate_off_the_loop` so that an `async def`
route can call it and get `generate(prompt)` back, while the event loop keeps serving
every other connection in the meantime. An exception raised by `generate` must reach the
caller.

Hints:
- Try the obvious version first: call `generate(prompt)` and return its result. The tests
  show what every other connection sees meanwhile.
- On one event loop, when can another coroutine run? What could you await that waits
  while `generate` runs somewhere other than the loop's own thread?
- asyncio's documentation has a section on running plain functions in threads.
- minisgl's own routes never call compute at all; chapter §3.1 says where it runs.

Check: pytest tests/quiz --learner -m q1
"""

from __future__ import annotations

from collections.abc import Callable

TODO = (
    "exercise q1: edit tests/quiz/exercises/q1_off_the_loop.py (its docstring says what "
    "to do), then check with: pytest tests/quiz --learner -m q1"
)


async def generate_off_the_loop(generate: Callable[[str], str], prompt: str) -> str:
    raise NotImplementedError(TODO)

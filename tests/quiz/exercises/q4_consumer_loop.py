"""Exercise q4 (quiz question 4): a consumer loop that never loses a wake-up.

Task: write `wait_for_ack(state)`, an async generator over one request's `RequestState`
(minisgl/server/frontend.py): its `buffer` (a `ReplyBuffer`) holds the pending output and
its `event` is set by the listener whenever the buffer got something new. Yield the
request's outputs (`state.buffer.take()` returns everything pending as one `Output`) until
the terminal one (`output.finished`), then end. Nothing may be lost: a reply that arrives
while your caller is busy with the previous output (writing it to a slow client, say)
must wake you again; and with nothing pending, the loop must really wait, not spin.

Hints:
- Four steps: wait, clear, take, yield. In which order can a reply fall between two of
  them, set the event, and have that `set()` erased?
- In a single-threaded event loop, the listener runs only while you are at an `await`.
- Chapter §3.4 walks through it; quiz question 4 asks what happens if the order changes.

Check: pytest tests/quiz --learner -m q4
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from minisgl.server.buffer import Output
from minisgl.server.frontend import RequestState

TODO = (
    "exercise q4: edit tests/quiz/exercises/q4_consumer_loop.py (its docstring says what "
    "to do), then check with: pytest tests/quiz --learner -m q4"
)


async def wait_for_ack(state: RequestState) -> AsyncIterator[Output]:
    raise NotImplementedError(TODO)
    yield  # never reached: it only makes this stub an async generator, as yours will be

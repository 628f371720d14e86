"""Exercise q7 (quiz question 7): the request scope that cleans up on every exit.

Task: write `request_scope`, an async context manager used as
`async with request_scope(states, uid, make_msg, send_one) as state:`.
- Entering it creates the uid's `RequestState(uid)` (minisgl/server/frontend.py) in
  `states`, where the listener finds it, then sends `make_msg(uid)` with `send_one`. If
  making or sending the message fails, the error propagates and no state is left; nothing
  reached the workers, so there is nothing to abort.
- Leaving the block removes the state, whatever the way out: the request's end, `break`,
  `return`, an exception (which must propagate), or the task being cancelled (a client
  that disconnected). It is removed right away, not a moment later.
- Leaving before the terminal reply arrived (the listener sets `state.terminal` when it
  does) also sends exactly one `AbortMsg(uid)`, so that the tokenizer worker and the
  scheduler free the uid too. After the terminal reply the workers have already let go:
  no abort then.

Hints:
- Which statements still run when a generator is closed at its `yield`, or when a
  cancelled task unwinds (chapter §6.1)?
- `send_one` is synchronous: it can run where an `await` would be interrupted.
- The stub is already an `asynccontextmanager`: the code before its one `yield` is the
  entry, the code after it the exit. Which exits reach that code, and how?
- Chapter §6.2 shows the reference's cancel path; §5 has minisgl's scope: write yours
  before you read it.

Check: pytest tests/quiz --learner -m q7
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import RequestState

TODO = (
    "exercise q7: edit tests/quiz/exercises/q7_request_scope.py (its docstring says what "
    "to do), then check with: pytest tests/quiz --learner -m q7"
)


@asynccontextmanager
async def request_scope(
    states: dict[int, RequestState],
    uid: int,
    make_msg: Callable[[int], TokenizeMsg],
    send_one: Callable[[TokenizerMsg], None],
) -> AsyncIterator[RequestState]:
    raise NotImplementedError(TODO)
    yield  # never reached: it only makes this stub an async generator, as yours will be

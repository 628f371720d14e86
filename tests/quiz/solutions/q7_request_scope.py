"""Reference solution of exercise q7: the request scope.

Contract: `async with request_scope(states, uid, make_msg, send_one) as state:` creates the
uid's RequestState in `states`, then sends `make_msg(uid)` to the tokenizer worker. If
making or sending the message fails, the state is removed and the error propagates;
nothing reached the workers, so nothing is aborted. Leaving the block on *any* path
(the end of the request, `break`, return, an exception, cancellation) removes the state
there and then; leaving before the terminal reply arrived (`state.terminal` is still
false) also sends exactly one AbortMsg(uid), so the workers free theirs.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import AbortMsg, TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import RequestState


@asynccontextmanager
async def request_scope(
    states: dict[int, RequestState],
    uid: int,
    make_msg: Callable[[int], TokenizeMsg],
    send_one: Callable[[TokenizerMsg], None],
) -> AsyncIterator[RequestState]:
    state = states[uid] = RequestState(uid)
    try:
        send_one(make_msg(uid))
    except BaseException:
        del states[uid]  # nothing reached the workers: nothing to abort
        raise
    try:
        yield state
    finally:
        # runs on every way out of the block; a cancelled task runs it too, and the send
        # is synchronous (it only queues a frame), so nothing here can be interrupted
        del states[uid]
        if not state.terminal:  # left early: the workers must drop this uid too
            send_one(AbortMsg(uid))

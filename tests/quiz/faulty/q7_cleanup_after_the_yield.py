"""FAULTY (quiz question 7): the cleanup written after the `yield`, with no `finally`.

The generator-tail mistake of the reference's `wait_for_ack`, in a context manager: an
exception in the block, or a cancelled task, is thrown in at the `yield`, and the lines
after it never run; the state stays and no AbortMsg is sent.
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
        del states[uid]
        raise
    yield state
    del states[uid]  # reached only when the block ends without an exception
    if not state.terminal:
        send_one(AbortMsg(uid))

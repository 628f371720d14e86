"""FAULTY (quiz question 7): an `await` inside the exit path, before the cleanup.

Right on every single path, including one cancellation. But a task can be cancelled
again while it unwinds (a server cancels a disconnected request, then shuts down): the
second CancelledError lands on that `await`, and the state is never removed, the
AbortMsg never sent. The send is synchronous so that the exit path need not await.
"""

from __future__ import annotations

import asyncio
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
    try:
        yield state
    finally:
        await asyncio.sleep(0)  # e.g. "let the last replies come in first"
        del states[uid]
        if not state.terminal:
            send_one(AbortMsg(uid))

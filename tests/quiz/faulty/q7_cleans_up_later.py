"""FAULTY (quiz question 7): the reference's cancel path: clean up 0.1 s later, elsewhere.

Like the reference's `abort_user`: the exit path starts another task that sleeps a
fixed 0.1 s and only then removes the state and sends the AbortMsg. The serving task is
over, its request is not: replies still land in its state, the backend still works for
it, and a shutdown in between loses the cleanup altogether.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import AbortMsg, TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import RequestState

ABORT_DELAY = 0.1  # seconds


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

    async def later() -> None:
        await asyncio.sleep(ABORT_DELAY)
        states.pop(uid, None)
        if not state.terminal:
            send_one(AbortMsg(uid))

    try:
        yield state
    finally:
        asyncio.get_running_loop().create_task(later())  # no reference kept, as there

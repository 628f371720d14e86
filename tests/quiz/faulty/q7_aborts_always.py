"""FAULTY (quiz question 7): an AbortMsg on every exit, also after the terminal reply.

The state goes on every path, but a request that ended normally gets an abort too: a
second ending sent for a uid the workers already let go of (and, with reused uids, a
wrong one).
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
    try:
        yield state
    finally:
        del states[uid]
        send_one(AbortMsg(uid))

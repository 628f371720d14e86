"""错误设计（测验第 7 题）：每次离开都发 AbortMsg，终止回复之后也发。

每条路上状态都删掉了，但正常结束的请求也收到一次中止：为一个 worker 早已放开的 uid
又发了一次结束（uid 被重用时，还会发错对象）。
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

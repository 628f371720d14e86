"""错误设计（测验第 7 题）：清理写在 `yield` 之后，没有 `finally`。

参考实现 `wait_for_ack` 写在生成器末尾的错误，搬进了上下文管理器：块里的异常或者任务
被取消，都会在 `yield` 处抛进来，它后面的几行永远不会运行；状态留下，也不发 AbortMsg。
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
    del states[uid]  # 只有块没有抛异常地结束时才走到这里
    if not state.terminal:
        send_one(AbortMsg(uid))

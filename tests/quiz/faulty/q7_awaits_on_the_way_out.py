"""错误设计（测验第 7 题）：退出路径上、清理之前有一个 `await`。

每条路单独走都没问题，被取消一次也没问题。但任务在逐层退出时可能再被取消一次（服务
先取消一个已断开的请求，随后又关停）：第二个 CancelledError 落在那个 `await` 上，
状态永远不会删除，AbortMsg 永远不会发出。发送是同步的，正是为了让退出路径不必 await。
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
        await asyncio.sleep(0)  # 例如「先让最后几条回复进来」
        del states[uid]
        if not state.terminal:
            send_one(AbortMsg(uid))

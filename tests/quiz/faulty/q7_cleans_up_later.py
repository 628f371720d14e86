"""错误设计（测验第 7 题）：参考实现的取消路径：0.1 秒后在别处清理。

像参考实现的 `abort_user` 那样：退出路径另起一个任务，它先固定睡 0.1 秒，然后才删除
状态、发出 AbortMsg。服务任务已经结束，它的请求却没有：回复照样落进它的状态，后端
照样为它工作，而如果中间恰好关停，清理就彻底丢了。
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import AbortMsg, TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import RequestState

ABORT_DELAY = 0.1  # 秒


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
        asyncio.get_running_loop().create_task(later())  # 和参考实现一样，不保留引用

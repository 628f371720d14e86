"""练习 q7 的参考实现：请求作用域。

约定：`async with request_scope(states, uid, make_msg, send_one) as state:` 在 `states`
里创建这个 uid 的 RequestState，然后把 `make_msg(uid)` 发给 Tokenizer Worker。如果造
消息或发消息失败，删除状态，错误向外传播；什么都没到达 worker，所以什么也不中止。
从*任何*路径离开这个块（请求结束、`break`、return、异常、取消），都当场删除状态；
终止回复到达之前离开（`state.terminal` 仍为假）时，还恰好发一次 AbortMsg(uid)，
让 worker 也释放它们持有的状态。
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import AbortMsg, TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import RequestState


# --8<-- [start:request_scope]
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
        del states[uid]  # 什么都没到达 worker：没有什么要中止
        raise
    try:
        yield state
    finally:
        # 从这个块离开的每条路都会运行这里；被取消的任务也会运行它，而且发送是同步的
        # （只是把一帧放进队列），所以这里没有什么能被打断
        del states[uid]
        if not state.terminal:  # 提前离开：worker 也必须丢掉这个 uid
            send_one(AbortMsg(uid))


# --8<-- [end:request_scope]

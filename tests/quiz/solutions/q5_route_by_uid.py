"""练习 q5 的参考实现：监听协程把回复送到各自的请求。

约定：`route(states, replies)` 按顺序处理 Tokenizer Worker 发来的一批 UserReply。
一条回复进入它自己 uid 的 RequestState 的缓冲区；缓冲区表示消费者有新东西时，置位
那个状态的事件；终止回复把状态标记为 `terminal`（它的请求不需要 AbortMsg）。如果
回复的 uid 没有状态（请求已经不在：结束了，或者被中止了），或者它的请求已经收到过
终止回复，这条回复就被丢弃：迟到的回复绝不创建状态。
"""

from __future__ import annotations

from minisgl.message import UserReply
from minisgl.server.frontend import RequestState


# --8<-- [start:route]
def route(states: dict[int, RequestState], replies: list[UserReply]) -> None:
    for reply in replies:
        state = states.get(reply.uid)
        if state is None or state.terminal:
            continue  # 迟到的回复：它的请求已经不在，或者已经结束
        if state.buffer.append(reply):
            state.event.set()
        if reply.finished:
            state.terminal = True


# --8<-- [end:route]

"""错误设计（测验第 5 题）：监听协程为不认识的回复腾出位置。

迟到的回复（它的请求已经不在：被取消了，或者结束了）得到一个新的 RequestState，
而没有哪个请求作用域会删除它：每个迟到的 token 泄漏一份。
"""

from __future__ import annotations

from minisgl.message import UserReply
from minisgl.server.frontend import RequestState


def route(states: dict[int, RequestState], replies: list[UserReply]) -> None:
    for reply in replies:
        state = states.setdefault(reply.uid, RequestState(reply.uid))
        if state.terminal:
            continue
        if state.buffer.append(reply):
            state.event.set()
        if reply.finished:
            state.terminal = True

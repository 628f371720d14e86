"""练习 q3 的参考实现：一个请求的回复缓冲区和唤醒事件。

约定：`ReplyInbox` 是监听协程为一个 uid 保存的东西。
- `deliver(reply)`（监听协程这一侧）存下回复的文本，以及它是否结束了请求；如果消费者
  有新东西可取（文本、finish_reason 或者结束），就置位 `event`。只更新计数的回复
  谁也不叫醒。
- `take()`（消费者这一侧）返回上次取走之后送来的全部文本，按到达顺序拼接，以及
  终止回复是否已经到达；取完之后缓冲区是空的。
minisgl 的 `ReplyBuffer` 对一个请求的每个选择做同样的事，另外记录 token 数。
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from minisgl.message import UserReply


# --8<-- [start:reply_inbox]
class Taken(NamedTuple):
    text: str  # 上次取走之后送来的全部文本，按顺序
    finished: bool  # 这个请求的终止回复已经送到


class ReplyInbox:
    def __init__(self) -> None:
        self.event = asyncio.Event()  # 「有新东西」：一个标志，不携带数据
        self._pieces: list[str] = []  # 数据：能存任意多条回复
        self._finished = False

    def deliver(self, reply: UserReply) -> None:
        if reply.incremental_output:
            self._pieces.append(reply.incremental_output)
        if reply.finished:
            self._finished = True
        news = reply.incremental_output or reply.finish_reason is not None or reply.finished
        if news:
            self.event.set()

    def take(self) -> Taken:
        text, self._pieces = "".join(self._pieces), []
        return Taken(text, self._finished)


# --8<-- [end:reply_inbox]

"""错误设计（测验第 3 题）：一个事件加一个位置，没有缓冲区。

事件只是一个标志，不携带数据：监听协程只能在消费者看的地方留下一条回复，所以消费者
运行之前到达的第二条回复会覆盖第一条。
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from minisgl.message import UserReply


class Taken(NamedTuple):
    text: str
    finished: bool


class ReplyInbox:
    def __init__(self) -> None:
        self.event = asyncio.Event()
        self._latest = ""  # 事件能交出的唯一一个位置
        self._finished = False

    def deliver(self, reply: UserReply) -> None:
        self._latest = reply.incremental_output
        self._finished = self._finished or reply.finished
        if reply.incremental_output or reply.finish_reason is not None or reply.finished:
            self.event.set()

    def take(self) -> Taken:
        text, self._latest = self._latest, ""
        return Taken(text, self._finished)

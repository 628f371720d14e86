"""错误设计（测验第 3 题）：一个列表，没有唤醒。

每条回复都存下了，却没人被通知：事件从不置位，所以等着的消费者永远醒不过来（它只能
去轮询）。
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
        self.event = asyncio.Event()  # 有，但没人置位它
        self._pieces: list[str] = []
        self._finished = False

    def deliver(self, reply: UserReply) -> None:
        self._pieces.append(reply.incremental_output)
        self._finished = self._finished or reply.finished

    def take(self) -> Taken:
        text, self._pieces = "".join(self._pieces), []
        return Taken(text, self._finished)

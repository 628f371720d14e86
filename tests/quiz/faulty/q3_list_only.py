"""FAULTY (quiz question 3): a list and no wake-up.

Every reply is kept, but nobody is told: the event is never set, so a waiting consumer
never wakes (it would have to poll).
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
        self.event = asyncio.Event()  # there, but nobody sets it
        self._pieces: list[str] = []
        self._finished = False

    def deliver(self, reply: UserReply) -> None:
        self._pieces.append(reply.incremental_output)
        self._finished = self._finished or reply.finished

    def take(self) -> Taken:
        text, self._pieces = "".join(self._pieces), []
        return Taken(text, self._finished)

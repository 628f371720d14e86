"""FAULTY (quiz question 3): an event and one slot, no buffer.

An event is a flag and carries no data: the listener can leave only one reply where the
consumer looks, so a second reply before the consumer runs overwrites the first.
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
        self._latest = ""  # the one slot an event can hand over
        self._finished = False

    def deliver(self, reply: UserReply) -> None:
        self._latest = reply.incremental_output
        self._finished = self._finished or reply.finished
        if reply.incremental_output or reply.finish_reason is not None or reply.finished:
            self.event.set()

    def take(self) -> Taken:
        text, self._latest = self._latest, ""
        return Taken(text, self._finished)

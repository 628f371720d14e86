"""Reference solution of exercise q3: one request's reply buffer and wake-up event.

Contract: `ReplyInbox` is what the listener keeps for one uid.
- `deliver(reply)` (the listener's side) keeps the reply's text and whether it ended the
  request, then sets `event` if the consumer has something new to take: text, a
  finish_reason or the end. A reply that only updates counts wakes nobody.
- `take()` (the consumer's side) returns all text delivered since the last take, joined
  in arrival order, and whether the terminal reply has arrived; it leaves the buffer empty.
minisgl's `ReplyBuffer` does the same for every choice of a request, with token counts.
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from minisgl.message import UserReply


class Taken(NamedTuple):
    text: str  # everything delivered since the last take, in order
    finished: bool  # the request's terminal reply has been delivered


class ReplyInbox:
    def __init__(self) -> None:
        self.event = asyncio.Event()  # "something new": a flag, it holds no data
        self._pieces: list[str] = []  # the data: it holds any number of replies
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

"""Exercise q3 (quiz question 3): a reply buffer and a wake-up event, per request.

Task: write `ReplyInbox`, what the listener keeps for one uid. It has a public
`event: asyncio.Event` that the consumer waits on.
- `deliver(reply)` is the listener's side: keep the reply's text and whether it is the
  request's terminal reply (`reply.finished`); wake the consumer when it has something new
  to take: text, a `finish_reason`, or the end. A reply that brings none of these (it only
  updates token counts) must not wake anyone.
- `take()` is the consumer's side: return a `Taken` with all text delivered since the last
  take, joined in arrival order, and whether the terminal reply has been delivered; after
  it, nothing is pending.

Hints:
- An event is a flag: five `set()` calls before anyone looks are one `set()`. Where do
  the texts of five replies wait meanwhile?
- And without the event, how would a waiting consumer learn that something arrived?
- `UserReply` is in minisgl/message/frontend.py; chapter §3.2 discusses both halves.

Check: pytest tests/quiz --learner -m q3
"""

from __future__ import annotations

from typing import NamedTuple

from minisgl.message import UserReply

TODO = (
    "exercise q3: edit tests/quiz/exercises/q3_buffer_and_event.py (its docstring says "
    "what to do), then check with: pytest tests/quiz --learner -m q3"
)


class Taken(NamedTuple):
    text: str  # everything delivered since the last take, in order
    finished: bool  # the request's terminal reply has been delivered


class ReplyInbox:
    def __init__(self) -> None:
        raise NotImplementedError(TODO)

    def deliver(self, reply: UserReply) -> None:
        raise NotImplementedError(TODO)

    def take(self) -> Taken:
        raise NotImplementedError(TODO)

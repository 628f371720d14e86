"""Reference solution of exercise q5: the listener's routing of replies to their requests.

Contract: `route(states, replies)` handles one batch of UserReply from the tokenizer
worker, in order. A reply goes into the buffer of its own uid's RequestState, whose event
is set if the buffer says the consumer has news; the terminal reply marks the state
`terminal` (its request needs no AbortMsg). A reply whose uid has no state (its request
is over, or was aborted) or whose request already ended is dropped: a late reply never
creates state.
"""

from __future__ import annotations

from minisgl.message import UserReply
from minisgl.server.frontend import RequestState


def route(states: dict[int, RequestState], replies: list[UserReply]) -> None:
    for reply in replies:
        state = states.get(reply.uid)
        if state is None or state.terminal:
            continue  # a late reply: its request is gone or already ended
        if state.buffer.append(reply):
            state.event.set()
        if reply.finished:
            state.terminal = True

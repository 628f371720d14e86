"""FAULTY (quiz question 5): the listener makes room for a reply it does not know.

A late reply (its request is gone: cancelled, or ended) gets a fresh RequestState, which
no request scope will ever remove: a leak for every late token.
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

"""Exercise q5 (quiz question 5): route interleaved replies to their own requests.

Task: write `route(states, replies)`, the listener's work for one batch of `UserReply`
from the tokenizer worker. `states` maps each live request's uid to its `RequestState`
(minisgl/server/frontend.py). Replies of different requests arrive interleaved, e.g.
A1 B1 B2 A2: each must reach only its own request's buffer, in order, and wake that
request's consumer when the buffer says it has news. The terminal reply (`finished`)
marks the state `terminal`, which tells the request scope that no AbortMsg is needed. A
reply for a uid that has no state, or for a request that already ended, is late: drop
it, and never create state for it.

Hints:
- `ReplyBuffer.append` (minisgl/server/buffer.py) returns whether the consumer has
  something new; a reply that only updates counts should wake nobody.
- Which requests does a late reply belong to, and which component would leak if the
  listener made room for it?
- Chapter §3.3 and §3.5 describe the listener and the A1 B1 B2 A2 case; the tests run your
  function between a real tokenizer worker and a fake scheduler.

Check: pytest tests/quiz --learner -m q5
"""

from __future__ import annotations

from minisgl.message import UserReply
from minisgl.server.frontend import RequestState

TODO = (
    "exercise q5: edit tests/quiz/exercises/q5_route_by_uid.py (its docstring says what "
    "to do), then check with: pytest tests/quiz --learner -m q5"
)


def route(states: dict[int, RequestState], replies: list[UserReply]) -> None:
    raise NotImplementedError(TODO)

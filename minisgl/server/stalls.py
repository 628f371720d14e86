"""The stall sweeper: a request whose client reads nothing while output waits is cancelled.

Contract: `StallSweeper(timeout)` observes a FrontendManager (minisgl/observe.py). A
response brackets each send of output to its client with `frontend.sending(state)`, which
the sweeper hears as the events "sending" and "sent"; it notes which task sends and since
when. `run()` (for the server's life) checks a few times per `timeout`; `check(now)` cancels
the task of every send blocked for more than `timeout` seconds of loop time and marks the
request `stalled`, so its scope exits (sending AbortMsg) and it ends as a slow client. The
output cap (`--max-pending-bytes`) cannot catch this case: a client that reads nothing while
the backend produces little never fills its buffer.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from minisgl.observe import RequestObserver

from .frontend import RequestState

logger = logging.getLogger(__name__)


class StallSweeper(RequestObserver):
    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        # uid -> (its state, the task sending, loop time the send began): sends under way
        self.sending: dict[int, tuple[RequestState, asyncio.Task, float]] = {}

    def event(self, state: RequestState | None, name: str, /, **detail: Any) -> None:
        if name == "sending":
            now = asyncio.get_running_loop().time()
            self.sending[state.uid] = (state, asyncio.current_task(), now)
        elif name == "sent":
            self.sending.pop(state.uid, None)

    def ended(self, state: RequestState, outcome: Any, /, **detail: Any) -> None:
        self.sending.pop(state.uid, None)

    def check(self, now: float) -> None:
        """Cancel the requests whose send has been blocked for more than `timeout` s."""
        for state, task, since in list(self.sending.values()):
            if now - since > self.timeout and not state.stalled:
                logger.warning(
                    "request %s (uid %d): the client read nothing for %.1f s while output "
                    "waited: aborting the request and closing the connection",
                    state.request_id,
                    state.uid,
                    now - since,
                )
                state.stalled = True
                task.cancel()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.25, self.timeout / 4))
            self.check(loop.time())

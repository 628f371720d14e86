"""Request observers: the one seam through which metrics, timelines and the stall sweeper
watch requests go by, without the core knowing any of them.

Contract: each component that serves requests (the API server's `FrontendManager`, the
tokenizer worker, the scheduler and its engine) holds one `Observers`, to which observers
are added at start-up (`component.observe(observer)`), and calls its hooks where a
request's life changes. Each hook does nothing here; an observer overrides the ones it
needs. The core serves the same with no observer; the one observer that acts, the stall
sweeper, cancels a stalled request's task as a disconnecting client would. The request
is passed as the calling component holds it: a `RequestState` in the API server,
a uid in the tokenizer worker, a `Req` in the scheduler (a uid where it refuses one).
"""

from __future__ import annotations

import enum
import logging
from typing import Any

logger = logging.getLogger(__name__)


class Outcome(enum.Enum):
    """How a request that reached the backend ended, as the API server tells its observers
    (the metrics' `outcome` label)."""

    FINISHED = "finished"
    ABORTED_CLIENT = "aborted_client"  # disconnect or early exit
    ABORTED_SLOW_CLIENT = "aborted_slow_client"  # output cap or stalled send
    ERROR = "error"  # with the OpenAI error code


class RequestObserver:
    # ---------------------------------------------------------------- a request's life
    def received(self, req: Any, /, **detail: Any) -> None:
        """The request reached this component (its scope opened, its prompt was
        tokenized, it was queued)."""

    def first_output(self, req: Any, /) -> None:
        """Its first output token reached this component."""

    def reply(self, req: Any, reply: Any, /) -> None:
        """The API server routes a reply to the request (called before it is buffered)."""

    def event(self, req: Any, name: str, /, **detail: Any) -> None:
        """Anything else worth a mark, by name: a grammar compiled, a stop string, a
        preemption, a send to the client begun or done (`req` None: no request yet)."""

    def ended(self, req: Any, outcome: Any, /, **detail: Any) -> None:
        """The request (or, in the scheduler, some of its sequences) ended here."""

    # ---------------------------------------------------------------- the step loop
    def step(self, batch: Any, number: int, /) -> None:
        """The scheduler launched step `number` over `batch`."""

    def phase(self, name: str, /) -> None:
        """From now on the step's time counts toward phase `name` (schedule, prepare,
        forward, sample, post)."""

    # ---------------------------------------------------------------- between processes
    def inbox(self, msg: Any, /) -> bool:
        """A message from the observers of the process before this one; True if taken."""
        return False

    def outbox(self, idle: bool = False, /) -> list[Any]:
        """Messages for the observers of the process after this one, due now (`idle`: the
        component has nothing else to do)."""
        return []


class Observers(RequestObserver):
    """Every observer added, called in order; none at first. An observer that raises is
    logged and skipped: watching a request never changes how it ends. Each hook calls
    only the observers that override it, so a hook no one watches costs one empty loop
    (the scheduler calls `phase` five times a step)."""

    HOOKS = (
        "received",
        "first_output",
        "reply",
        "event",
        "ended",
        "step",
        "phase",
        "inbox",
        "outbox",
    )

    def __init__(self, *observers: RequestObserver) -> None:
        self.observers: list[RequestObserver] = []
        self._hooks: dict[str, tuple[Any, ...]] = {hook: () for hook in self.HOOKS}
        for observer in observers:
            self.add(observer)

    def add(self, observer: RequestObserver) -> None:
        self.observers.append(observer)
        for hook in self.HOOKS:
            if getattr(type(observer), hook) is not getattr(RequestObserver, hook):
                self._hooks[hook] += (getattr(observer, hook),)

    def _each(self, hook: str, *args: Any, **detail: Any) -> list[Any]:
        results = []
        for method in self._hooks[hook]:
            try:
                results.append(method(*args, **detail))
            except Exception:
                logger.exception("observer %s failed in %s()", type(method.__self__).__name__, hook)
        return results

    def received(self, req, /, **detail) -> None:
        self._each("received", req, **detail)

    def first_output(self, req, /) -> None:
        self._each("first_output", req)

    def reply(self, req, reply, /) -> None:
        self._each("reply", req, reply)

    def event(self, req, name, /, **detail) -> None:
        self._each("event", req, name, **detail)

    def ended(self, req, outcome, /, **detail) -> None:
        self._each("ended", req, outcome, **detail)

    def step(self, batch, number, /) -> None:
        self._each("step", batch, number)

    def phase(self, name, /) -> None:
        self._each("phase", name)

    def inbox(self, msg, /) -> bool:
        return any(self._each("inbox", msg))

    def outbox(self, idle=False, /) -> list:
        return [m for msgs in self._each("outbox", idle) for m in msgs]

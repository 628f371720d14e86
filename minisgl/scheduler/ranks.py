"""Ranks: tensor parallelism at the scheduler's I/O seam.

With tensor parallelism there is one scheduler per rank, each with its own engine (its
shard) and its own policy, and rank 0's decides. Every rank makes the same calls on its
`Scheduler` in the same order, so every policy admits, aborts and schedules the same
sequences into the same batch in the same step, and allocates the same pages and slots:

- rank 0 is driven from outside (the server's process loop, or the offline `LLM`). Each of
  its scheduler's calls that changes state passes through `agree(op, value)` first, which
  broadcasts the call and what must be equal on every rank: the messages received
  ("msgs"), and for a step ("step", "advance") the requests whose grammar matcher rank 0
  found built (each rank builds its own matchers, and they are not ready at the same
  moment);
- every other rank runs `follow(scheduler)`: it receives each call and makes it on its own
  scheduler, whose `agree` then returns rank 0's value instead of its own.
The policy itself has no rank code. Seeds come from one generator seeded alike on every
rank (`shared_seeds`); the sampled tokens are rank 0's (the sampler broadcasts them). A
state query gathers every rank's state into rank 0's answer (`gather_state`: `ranks`).

Between requests rank 0 may wait for hours, and a collective would time out: before it
blocks waiting for work it calls `rest()`, the other ranks sleep on the rendezvous store
(not inside a collective) and its next `agree` wakes them first (minisgl/distributed.py).
`stop()` ends the other ranks' `follow` loops. A rank that dies or stops makes a
collective raise `RanksFailed` within the group's timeout, on whichever rank waits.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from minisgl.distributed import (
    broadcast_object,
    gather_objects,
    sleep_until_woken,
    tp,
    wake_followers,
)

if TYPE_CHECKING:
    from minisgl.message import SchedulerState

    from .scheduler import Scheduler

# the scheduler calls rank 0 tells the other ranks to make, by name
_CALLS: dict[str, Callable[[Scheduler, Any], object]] = {
    "msgs": lambda scheduler, msgs: scheduler.process_msgs(msgs),
    "step": lambda scheduler, _: scheduler.step(),
    "advance": lambda scheduler, _: scheduler.advance(),
}


class Ranks:
    """This process's place among the ranks (one rank of one when there is no group)."""

    def __init__(self) -> None:
        self.tp = tp()
        self._rests = 0  # rank 0: rest periods so far (the others sleep through them)
        self._resting = False
        self._following: tuple[str, Any] | None = None  # another rank: rank 0's call

    @property
    def many(self) -> bool:
        return self.tp.size > 1

    def shared_seeds(self) -> random.Random:
        """The generator of requests' seeds: fresh randomness, the same on every rank (one
        collective, made by every rank's scheduler as it is built)."""
        seeds = random.SystemRandom()
        if self.many:  # the same seeds on every rank, drawn in the same order
            return random.Random(broadcast_object(seeds.getrandbits(63)))
        return seeds

    # --8<-- [start:agree]
    def agree(self, op: str, value: Any) -> Any:
        """The value every rank uses for this call: rank 0 broadcasts its own (waking the
        others first if they rest); another rank gets rank 0's, for the call it follows."""
        if not self.many:
            return value
        if self.tp.leader:
            if self._resting:
                wake_followers(self._rests)
                self._resting = False
            broadcast_object((op, value))
            return value
        following, self._following = self._following, None
        assert following is not None and following[0] == op, f"{op} is not rank 0's call"
        return following[1]

    # --8<-- [end:agree]

    def rest(self) -> None:
        """Rank 0, about to wait for work (for as long as it takes): the other ranks wait
        on the rendezvous store, not inside a collective that would time out."""
        if self.many and self.tp.leader and not self._resting:
            self._rests += 1
            broadcast_object(("rest", self._rests))
            self._resting = True

    def stop(self) -> None:
        """Rank 0: end the other ranks' `follow` loops."""
        if self.many and self.tp.leader:
            self.agree("exit", None)

    def follow(self, scheduler: Scheduler, alive: Callable[[], bool] = lambda: True) -> None:
        """A rank other than 0: make rank 0's calls on `scheduler` until it stops us;
        `alive()` is asked while resting (False: give up)."""
        while True:
            op, arg = broadcast_object()
            if op == "exit":
                return
            if op == "rest":
                sleep_until_woken(arg, alive)
                continue
            self._following = (op, arg)
            _CALLS[op](scheduler, arg)

    def gather_state(self, state: SchedulerState) -> SchedulerState:
        """A state answer: with several ranks, rank 0's carries every rank's own (and its
        process) in `ranks`."""
        if self.many:
            ranks = gather_objects(state.on_rank(self.tp.rank, os.getpid()))
            if self.tp.leader:
                state.ranks = ranks
        return state

"""Scheduler: the step loop. It owns the engine's launch, the overlap pipeline and the
process loop; what runs in each step is its policy's (policy.py), which sees the engine only
through its `Limits`. This is the one module of the scheduler that knows the engine.

Contract (the message-shaped interface the server drives):
- `process_msgs(msgs)`: a `UserMsg` is admitted by the policy (or answered at once with a
  `BackendErrorMsg`); `AbortBackendMsg` removes the request (or one choice) wherever it is
  and frees its slots and pages (a uid it does not know is ignored); `StateQueryMsg` is
  answered with `state()`, after `flush_cache()` if asked.
- `step()` launches one step (every decoding sequence plus the prefill chunks the paced
  token budget allows: pacing.py) and returns one `DetokenizeMsg` per sequence that
  produced a token. `advance()` is what the loop calls: with overlap scheduling it launches
  the next step, then returns the replies of the one before, so the host schedules step
  N+1 while the device runs step N; without overlap it is `step()`.
- `run_forever(io)` is the process loop: receive, advance, send, until `io.receive` raises;
  `fail_all(error)` is an error reply for every request held, for a loop that must stop.
- Observers (`observe`) hear each request queued, its first token, preemptions and its end,
  each step launched and where the step's time goes; `outbox` batches go out with replies.
- With tensor parallelism each call that changes state first agrees with the other ranks
  (`ranks.agree`: rank 0 broadcasts, the others make the same call: ranks.py).
"""

from __future__ import annotations

import time
from typing import Protocol

from msgspec import UNSET

from minisgl.core import Req
from minisgl.engine.engine import Engine, StepHandle
from minisgl.message import (
    AbortBackendMsg,
    BackendMsg,
    ErrorInfo,
    SchedulerState,
    SchedulerStateMsg,
    StateQueryMsg,
    TokenizerMsg,
    UserMsg,
)
from minisgl.observe import Observers, RequestObserver

from .config import SchedulerConfig
from .limits import Limits
from .pacing import PrefillPacer
from .policy import Policy, Step
from .ranks import Ranks


class SchedulerIO(Protocol):
    def receive(self, blocking: bool) -> list[BackendMsg]: ...

    def send(self, replies: list[TokenizerMsg]) -> None: ...


class Scheduler:
    def __init__(
        self,
        engine: Engine,
        config: SchedulerConfig | None = None,
    ) -> None:
        self.engine = engine
        self.observer = Observers()  # added with observe(): timelines, a benchmark's timer
        engine.set_observer(self.observer)  # the engine marks its phases of each step there
        self.steps = 0  # steps launched since start
        self.config = config if config is not None else SchedulerConfig()
        self.ranks = Ranks()
        overlap = self.config.overlap_schedule
        self.overlap = engine.device.type == "cuda" if overlap is None else overlap
        if self.overlap:  # the engine's start-up self-check may fall back to synchronous steps
            self.overlap = engine.check_overlap()
        self.limits = Limits.of(engine)  # all the policy knows of the engine
        on_cpu = engine.device.type == "cpu"
        self.pacer = PrefillPacer.configured(self.config, on_cpu, self.limits)
        self.grammars = engine.grammars  # builds the matchers of constrained requests
        self.policy = Policy(
            self.limits,
            self.config,
            self.observer,
            self.ranks.shared_seeds(),
            self.pacer.budget,
            matchers=self.grammars,
        )
        self._in_flight: _Launched | None = None  # launched, results not read yet

    def observe(self, observer: RequestObserver) -> None:
        self.observer.add(observer)

    # ------------------------------------------------------------------ messages
    @property
    def has_work(self) -> bool:
        return self._can_step or self.policy.building

    @property
    def _can_step(self) -> bool:
        return self._in_flight is not None or self.policy.runnable

    def state(self) -> SchedulerState:
        return self.policy.state()

    def process_msg(self, msg: BackendMsg) -> list[TokenizerMsg]:
        return self.process_msgs([msg])

    def process_msgs(self, msgs: list[BackendMsg]) -> list[TokenizerMsg]:
        msgs = self.ranks.agree("msgs", msgs)
        return [reply for msg in msgs for reply in self._process(msg)]

    def _process(self, msg: BackendMsg) -> list[TokenizerMsg]:
        if isinstance(msg, UserMsg):
            error = self.policy.add(msg)
            if error:
                self.observer.ended(msg.uid, "error", kind=error.error.kind.value)
            else:
                n, prompt_tokens = msg.sampling_params.n, len(msg.input_ids)
                self.observer.received(msg.uid, n=n, prompt_tokens=prompt_tokens)
            return [error] if error else []
        if isinstance(msg, AbortBackendMsg):
            self.abort_req(msg.uid, msg.index)
            return []
        if isinstance(msg, StateQueryMsg):
            flushed = self.flush_cache() if msg.flush_cache else UNSET  # counted after it
            state = self.state()
            state.flushed_pages = flushed
            return [SchedulerStateMsg(msg.query_id, self.ranks.gather_state(state))]
        raise TypeError(f"scheduler cannot handle {type(msg).__name__}")

    def abort_req(self, uid: int, index: int | None = None, how: str = "aborted") -> list[Req]:
        """Remove a request's sequences (one choice, or all) wherever they are."""
        return self.policy.abort(uid, index, how)

    def fail_all(self, error: ErrorInfo) -> list[TokenizerMsg]:
        """An error reply for every request held (the loop cannot go on)."""
        return self.policy.fail_all(error)

    def flush_cache(self) -> int:
        """Empty the prefix cache: the pages freed, or -1 (nothing done) while any request
        is in flight here."""
        if self.has_work:
            return -1
        return self.policy.cache_manager.flush_cache()

    # ------------------------------------------------------------------ one step
    # --8<-- [start:step]
    def step(self) -> list[TokenizerMsg]:
        """One step, launched and read back (replies of a step still in flight first)."""
        return self._step(self.ranks.agree("step", self.policy.constrained.ready()))

    def _step(self, built: list[int]) -> list[TokenizerMsg]:
        replies = self.policy.admit_built(built) + self._take_in_flight()
        launched = self.launch_step()
        return replies + (self.finish_step(launched) if launched else [])

    def advance(self) -> list[TokenizerMsg]:
        """With overlap: launch the next step, then read the previous one. Else `step()`."""
        built = self.ranks.agree("advance", self.policy.constrained.ready())
        if not self.overlap:
            return self._step(built)
        replies = self.policy.admit_built(built)
        launched = self.launch_step()
        replies += self._take_in_flight()
        self._in_flight = launched
        return replies

    def _take_in_flight(self) -> list[TokenizerMsg]:
        launched, self._in_flight = self._in_flight, None
        return self.finish_step(launched) if launched else []

    def launch_step(self) -> _Launched | None:
        """Schedule a batch and launch it; the sequences' host state moves on at once."""
        self.observer.phase("schedule")
        step = self.policy.schedule()
        # the page table rows of this step, on the device before it runs
        self.engine.write_pages(self.policy.cache_manager.take_edits())
        self.observer.phase("post")
        if step is None:
            return None
        batch = step.batch
        self.steps += 1
        self.observer.step(batch, self.steps)  # the step's start, before the forward pass
        started = time.perf_counter()
        handle = self.engine.launch(batch)
        self.observer.phase("post")
        if self.engine.device.type == "cpu":  # the step has run: its time tells the speed
            self.pacer.observe(batch, time.perf_counter() - started)
        self.policy.launched(step)
        return _Launched(step, handle)

    def finish_step(self, launched: _Launched) -> list[TokenizerMsg]:
        """Read a launched step's tokens: the policy's replies to them."""
        self.observer.phase("sample")  # the wait for the step's tokens
        out = launched.handle.result()
        self.observer.phase("post")
        return self.policy.update(launched.step, out)

    # --8<-- [end:step]

    # ------------------------------------------------------------------ process loop
    def run_forever(self, io: SchedulerIO) -> None:
        """Receive, step, send, for as long as `io.receive` returns: the process's I/O
        raises when the launcher is gone (io.py), and tests end the loop the same way."""
        while True:
            if not self._can_step:  # only matchers being built: wait for them, not spin
                self.policy.constrained.wait(0.01)
            if not self.has_work:
                self.ranks.rest()
            msgs = io.receive(blocking=not self.has_work)
            replies = self.process_msgs(msgs) if msgs else []
            replies += self.advance()
            replies += self.observer.outbox(not self.has_work)  # e.g. a timeline batch
            if replies:
                io.send(replies)


class _Launched:
    """A step launched on the device: the policy's step and the handle of its tokens."""

    __slots__ = ("step", "handle")

    def __init__(self, step: Step, handle: StepHandle) -> None:
        self.step, self.handle = step, handle

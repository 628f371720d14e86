"""Scheduler: the step loop. It owns the engine's launch, the overlap pipeline and the
process loop; what runs in each step is its policy's (policy.py), and with tensor
parallelism every rank runs this same loop over the same policy (ranks.py).

Contract (the message-shaped interface the server drives):
- `process_msg(msg)` / `process_msgs(msgs)` take incoming messages: a `UserMsg` is admitted
  by the policy (`Policy.add`: checked against what only the model knows, or answered at
  once with a `BackendErrorMsg`); `AbortBackendMsg` removes the request (or one of its
  choices) wherever it is and frees its slots and pages (`abort_req`; a uid the scheduler
  does not know is ignored: it may have just finished); `StateQueryMsg` is answered with
  `state()` (every rank's, with tensor parallelism), after `flush_cache()` if asked.
- `step()` runs one forward pass over every decoding sequence plus as many prefill chunks
  as the token budget (`SchedulerConfig.max_prefill_tokens`, paced on a CPU: pacing.py)
  allows, and returns one `DetokenizeMsg` per sequence that produced a token; the last one
  of a sequence carries its finish_reason, and its resources are already free when it is
  returned.
- `advance()` is what the loop calls instead: with overlap scheduling it launches the next
  step and then returns the replies of the step launched before it, so the host schedules
  step N+1 and reads step N's tokens while the device runs step N+1; without overlap it is
  `step()`. Both are `launch_step()` followed, now or one call later, by `finish_step()`:
  `launch_step` asks the policy for a step, hands the cache manager's page-table edits to
  the engine (`Engine.write_pages`), launches it and lets the policy move the sequences'
  host state on; `finish_step` waits for its tokens and gives them to the policy.
- `run_forever(io)` is the process loop: receive, advance, send, until `io.receive` raises;
  `fail_all(error)` is an error reply for every request held, for a loop that must stop.
- With tensor parallelism each call that changes state (`process_msgs`, `step`, `advance`)
  first agrees with the other ranks (`self.ranks.agree`: rank 0 broadcasts the messages
  and the matchers it found built, the other ranks, in `Ranks.follow`, make the same call
  with rank 0's values); before it blocks waiting for work the loop rests them
  (`self.ranks.rest()`; the offline `LLM` calls it too). A state query's answer gathers
  every rank's state (`ranks`).

`cache_manager`, `prefill_manager`, `decode_manager`, `table_manager`, `grammars` and
`num_preemptions` are the policy's, read through.
"""

from __future__ import annotations

import time
from typing import Protocol

from msgspec import UNSET

from minisgl.core import Req
from minisgl.engine.engine import Engine, StepHandle
from minisgl.engine.grammar import Grammars
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

from .cache import CacheManager
from .config import SchedulerConfig
from .decode import DecodeManager
from .limits import Limits
from .pacing import PrefillPacer
from .policy import Policy, Step
from .prefill import PrefillManager
from .ranks import Ranks
from .table import TableManager

DEFAULT_CPU_STEP_SECONDS = 0.3  # SchedulerConfig.prefill_step_seconds on a CPU


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
        pace = self.config.prefill_step_seconds
        if pace is None:  # a CPU runs a step inside its launch: it can be timed and paced
            pace = DEFAULT_CPU_STEP_SECONDS if engine.device.type == "cpu" else 0
        self.limits = Limits.of(engine)  # all the policy knows of the engine
        self.pacer = PrefillPacer(
            self.config.max_prefill_tokens, pace or None, min_rows=self.limits.prefill_rows
        )
        grammars = Grammars(engine.model_dir, self.limits.vocab_size)
        self.policy = Policy(
            self.limits,
            self.config,
            self.observer,
            self.ranks.shared_seeds(),
            self.pacer.budget,
            matchers=grammars,
        )
        self._in_flight: _Launched | None = None  # launched, results not read yet

    def observe(self, observer: RequestObserver) -> None:
        self.observer.add(observer)

    # the policy's parts, read through (tests, notebooks, benchmarks and io.py use them)
    @property
    def cache_manager(self) -> CacheManager:
        return self.policy.cache_manager

    @property
    def prefill_manager(self) -> PrefillManager:
        return self.policy.prefill_manager

    @property
    def decode_manager(self) -> DecodeManager:
        return self.policy.decode_manager

    @property
    def table_manager(self) -> TableManager:
        return self.policy.table_manager

    @property
    def grammars(self) -> Grammars:
        return self.policy.matchers

    @property
    def num_preemptions(self) -> int:
        return self.policy.num_preemptions

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
        return self._step(self.ranks.agree("step", self.policy.ready_matchers()))

    def _step(self, built: list[int]) -> list[TokenizerMsg]:
        replies = self.policy.admit_built(built) + self._take_in_flight()
        launched = self.launch_step()
        return replies + (self.finish_step(launched) if launched else [])

    def advance(self) -> list[TokenizerMsg]:
        """With overlap: launch the next step, then read the previous one. Else `step()`."""
        built = self.ranks.agree("advance", self.policy.ready_matchers())
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
            prefill = sum(r.extend_len for r in batch.reqs[batch.decodes :])
            self.pacer.observe(prefill, batch.decodes, time.perf_counter() - started)
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
                self.policy.wait_for_matchers(0.01)
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

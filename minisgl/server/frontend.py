"""FrontendManager: the API server's per-uid state, its one listener, and the request scope.

Contract:
- Every HTTP request that reaches the backend lives inside `async with frontend.request(...)`.
  Entering it allocates a uid, creates the uid's state (a reply buffer and a wake-up event)
  and sends the TokenizeMsg. Leaving it, on *every* path, deletes the state; leaving before
  the terminal reply arrived (client disconnect, cancellation, an exception, a consumer that
  stopped early) also sends AbortMsg so the workers free theirs. Nothing is cleaned up at the
  tail of a generator, where an early `break` would skip it.
- One listener coroutine (`listen`) receives every UserReply. It appends the reply to its
  uid's buffer and sets the uid's event; a reply for a uid with no state is dropped (late
  messages never recreate state). A buffer that grows past `max_pending_bytes` because the
  consumer does not keep up ends the request with an error and aborts it in the backend.
- `wait_for_ack(state)` is the consumer side: wait, clear, take everything pending as one
  coalesced `Output`, yield it; it ends after the terminal output.
- Sends are synchronous (they only queue a ZMQ frame), so a `finally` can send AbortMsg
  without awaiting, even in a task that is being cancelled.
- The frontend decides how each request ended (finished, aborted by its client, aborted
  as a slow client, or an error) and tells the metrics; a response marks the time it
  spends in a send to the client with `state.sending()`, and `sweep_stalls` cancels a
  request whose send stays blocked too long.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import msgspec

from minisgl.message import (
    AbortMsg,
    ErrorInfo,
    ErrorKind,
    FrontendMsg,
    LifecycleQueryMsg,
    LifecycleStateMsg,
    SchedulerState,
    TimelineMsg,
    TokenizeMsg,
    TokenizerMsg,
    UserReply,
)
from minisgl.message.timeline import API, Aborted, End, Errored, Finished, FirstOutput

from .buffer import Output, ReplyBuffer
from .errors import RequestFailed, error_code
from .metrics import Outcome, ServerMetrics
from .middleware import arrival_var, request_id_var
from .timelines import NoTimelines, Timelines

logger = logging.getLogger(__name__)


class Lifecycle(msgspec.Struct):
    """Every process's live per-uid state (`lifecycle()`); the HTTP edge answers it as
    JSON through `msgspec.to_builtins`, which leaves out the scheduler's unset fields."""

    frontend: dict[str, int]
    tokenizer: dict[str, int]
    scheduler: SchedulerState


@dataclass(eq=False)
class RequestState:
    uid: int
    request_id: str = "-"  # the X-Request-Id, for log lines about this request
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    event: asyncio.Event = field(default_factory=asyncio.Event)  # shared within a group
    # set once the terminal reply (or a local error) is in the buffer: no abort needed
    terminal: bool = False
    # loop time at which a send to the client began and has not returned (stall detection)
    sending_since: float | None = None
    task: asyncio.Task | None = None  # the task serving the request, cancelled on a stall
    stalled: bool = False
    created_at: float = field(default_factory=time.monotonic)
    last_token_at: float | None = None  # arrival of the latest output token (metrics)
    arrival: float = 0.0  # when the HTTP request came in (time.monotonic())
    got_output: bool = False  # a reply with output has come (the timeline's first_output)

    @contextmanager
    def sending(self) -> Iterator[None]:
        """Around one send to the client: if it stays blocked (the client reads nothing),
        the stall sweeper cancels the task that is sending."""
        self.task = asyncio.current_task()
        self.sending_since = asyncio.get_running_loop().time()
        try:
            yield
        finally:
            self.sending_since = None

    def outcome(self) -> tuple[Outcome, str]:
        """How the request ended, for the metrics: the outcome and its error code."""
        error = self.buffer.error
        if error is not None and error.kind is ErrorKind.SLOW_CLIENT:
            return Outcome.ABORTED_SLOW_CLIENT, ""
        if error is not None:
            return Outcome.ERROR, error_code(error) or "error"
        if self.buffer.finished:
            return Outcome.FINISHED, ""
        if self.stalled:
            return Outcome.ABORTED_SLOW_CLIENT, ""
        return Outcome.ABORTED_CLIENT, ""

    def end_event(self, outcome: Outcome, code: str, t: float) -> End:
        """The API server's end of the request's timeline at `t`, from its `outcome()`."""
        error = self.buffer.error
        if outcome is Outcome.FINISHED:
            return Finished(self.uid, API, t, reason=self.buffer.choices[0].finish_reason)
        if outcome is Outcome.ABORTED_CLIENT:
            return Aborted(self.uid, API, t, by="client_disconnect")
        if outcome is Outcome.ABORTED_SLOW_CLIENT:
            return Aborted(self.uid, API, t, by="stall" if error is None else "slow_client")
        if error is not None and error.kind is ErrorKind.SHUTTING_DOWN:
            return Aborted(self.uid, API, t, by="shutdown")
        return Errored(self.uid, API, t, code=code, kind=error.kind.value if error else None)


class FrontendManager:
    def __init__(
        self,
        send: Callable[[list[TokenizerMsg]], None],
        recv: Callable[[], Awaitable[list[FrontendMsg]]],
        max_pending_bytes: int = 1 << 20,
        max_response_bytes: int = 16 << 20,
        report_cached_tokens: bool = True,
        max_concurrent: int = 1 << 30,
        metrics: ServerMetrics | None = None,
        timelines: Timelines | None = None,
        worker_fault: Callable[[], ErrorInfo | None] | None = None,
    ) -> None:
        self._send = send
        self._recv = recv
        self.max_pending_bytes = max_pending_bytes
        self.max_response_bytes = max_response_bytes  # a non-streamed answer, collected
        self.report_cached_tokens = report_cached_tokens  # usage.prompt_tokens_details
        self.max_concurrent = max_concurrent
        self.metrics = metrics
        self.timelines = timelines if timelines is not None else NoTimelines()
        # why a worker process cannot serve now (the supervisor's heartbeats), or None
        self.worker_fault = worker_fault or (lambda: None)
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        self.uid_counter = itertools.count()
        self.states: dict[int, RequestState] = {}
        self.backend_error: ErrorInfo | None = None  # set when a worker process died
        self._query_ids = itertools.count()
        self._queries: dict[int, asyncio.Future[LifecycleStateMsg]] = {}

    # ---------------------------------------------------------------- state
    def new_user(self, n: int = 1, event: asyncio.Event | None = None) -> RequestState:
        buffer = ReplyBuffer(n, report_cached=self.report_cached_tokens)
        state = RequestState(next(self.uid_counter), request_id_var.get(), buffer)
        if event is not None:
            state.event = event
        self.states[state.uid] = state
        return state

    def refusal(self) -> ErrorInfo | None:
        """Why no request can be served now, whatever the load: a dead worker (`fail_all`),
        draining, or a worker that does not answer; None when serving."""
        if self.backend_error is not None:
            return self.backend_error
        if self.draining:
            return ErrorInfo(ErrorKind.SHUTTING_DOWN, "the server is shutting down")
        return self.worker_fault()  # a request would only hang behind a silent worker

    def check_admission(self) -> None:
        """Raise RequestFailed unless a new request may start now."""
        if (refused := self.refusal()) is not None:
            raise RequestFailed(refused)
        if len(self.states) >= self.max_concurrent:
            message = (
                f"the server is at its limit of {self.max_concurrent} requests in flight; "
                "retry shortly"
            )
            raise RequestFailed(ErrorInfo(ErrorKind.OVERLOADED, message))

    def send_one(self, msg: TokenizerMsg) -> None:
        self._send([msg])

    def state(self) -> dict[str, int]:
        return {
            "requests": len(self.states),
            "pending_bytes": sum(s.buffer.pending_bytes for s in self.states.values()),
        }

    # --8<-- [start:request_scope]
    @asynccontextmanager
    async def request(
        self,
        make_msg: Callable[[int], TokenizeMsg],
        n: int = 1,
        event: asyncio.Event | None = None,
    ) -> AsyncIterator[RequestState]:
        self.check_admission()
        state = self.new_user(n, event)
        admitted = time.monotonic()
        try:
            self.send_one(make_msg(state.uid))
        except BaseException as exc:  # nothing reached the workers: nothing to abort
            del self.states[state.uid]
            if isinstance(exc, (msgspec.EncodeError, OverflowError, UnicodeEncodeError)):
                # e.g. a lone surrogate in the text: the request is at fault
                message = f"the request cannot be encoded: {exc}"
                raise RequestFailed(ErrorInfo(ErrorKind.UNENCODABLE_REQUEST, message)) from exc
            raise
        arrival, endpoint = arrival_var.get() or (state.created_at, "-")
        state.arrival = arrival
        self.timelines.start(state.uid, state.request_id, endpoint, arrival, admitted)
        try:
            yield state
        finally:
            ended = time.monotonic()  # before the abort: the workers' ends come after it
            del self.states[state.uid]
            if not state.terminal:  # left early: the workers must drop this uid too
                self.send_one(AbortMsg(state.uid))
            self._on_end(state, ended)

    # --8<-- [end:request_scope]

    def _on_end(self, state: RequestState, ended: float) -> None:
        """Tell the metrics and the timeline how the request ended."""
        outcome, code = state.outcome()
        if self.metrics is not None:
            self.metrics.on_request_end(outcome, code)
            if outcome is Outcome.FINISHED:
                self.metrics.on_finished(ended - state.arrival)
        buffer = state.buffer
        end = state.end_event(outcome, code, ended)
        self.timelines.end(end, buffer.prompt_tokens, buffer.completion_tokens)

    def debug_requests(self, **query) -> dict:
        """GET /debug/requests: the timelines of requests in flight and recently ended
        (`query`: Timelines.snapshot's limit, since and request_id)."""
        counts = {
            uid: (s.buffer.prompt_tokens, s.buffer.completion_tokens)
            for uid, s in self.states.items()
        }
        return self.timelines.snapshot(counts, **query)

    # --8<-- [start:listen]
    # --8<-- [start:listen_loop]
    async def listen(self) -> None:
        while True:
            for msg in await self._recv():
                if isinstance(msg, LifecycleStateMsg):
                    if (fut := self._queries.get(msg.query_id)) and not fut.done():
                        fut.set_result(msg)
                    continue
                # --8<-- [end:listen_loop]
                if isinstance(msg, TimelineMsg):
                    self._on_timeline(msg)
                    continue
                # --8<-- [start:listen_route]
                state = self.states.get(msg.uid)
                if state is None or state.terminal:
                    continue  # a late reply: its request is gone or already ended
                if self.metrics is not None:
                    self._count_tokens(state, msg)
                if not state.got_output and msg.completion_tokens:
                    state.got_output = True
                    self.timelines.record(state.uid, FirstOutput)
                if state.buffer.append(msg):
                    state.event.set()
                if msg.finished:
                    state.terminal = True
                elif state.buffer.pending_bytes > self.max_pending_bytes:
                    self._fail_slow_client(state)
                # --8<-- [end:listen_route]

    # --8<-- [end:listen]

    def _on_timeline(self, msg: TimelineMsg) -> None:
        self.timelines.add(msg)
        if self.metrics is not None:
            self.metrics.on_timeline(msg)

    def _count_tokens(self, state: RequestState, reply: UserReply) -> None:
        new_tokens = reply.completion_tokens - state.buffer.choices[reply.index].tokens
        if new_tokens <= 0:
            return
        now, gap = time.monotonic(), None
        if state.last_token_at is None:
            self.metrics.on_first_token(now - state.created_at, reply.prompt_tokens)
        else:
            gap = (now - state.last_token_at) / new_tokens
        self.metrics.on_tokens(new_tokens, gap)
        state.last_token_at = now

    def _fail_slow_client(self, state: RequestState) -> None:
        logger.warning(
            "request %s (uid %d): more than %d bytes of output wait unread: aborting it",
            state.request_id,
            state.uid,
            self.max_pending_bytes,
        )
        message = (
            f"the client did not read the output fast enough (more than "
            f"{self.max_pending_bytes} bytes waited); the request was aborted"
        )
        self.end_with_error(state, ErrorInfo(ErrorKind.SLOW_CLIENT, message))

    def end_with_error(self, state: RequestState, error: ErrorInfo) -> None:
        """End a live request here and now; the backend is told to drop it."""
        state.buffer.finish(error)
        if not state.terminal:
            state.terminal = True
            self.send_one(AbortMsg(state.uid))
        state.event.set()

    @asynccontextmanager
    async def requests(
        self, make_msgs: list[Callable[[int], TokenizeMsg]], n: int = 1
    ) -> AsyncIterator[list[RequestState]]:
        """One HTTP request with several prompts: one scope (uid) per prompt, one wake-up
        event for all of them; leaving the block leaves every scope."""
        event = asyncio.Event()
        async with AsyncExitStack() as stack:
            yield [await stack.enter_async_context(self.request(m, n, event)) for m in make_msgs]

    # --8<-- [start:wait_for_ack]
    async def wait_for_ack(self, *states: RequestState) -> AsyncIterator[Output]:
        """Outputs of one request (or of a group sharing one event) until it is over."""
        event = states[0].event
        while True:
            await event.wait()
            event.clear()
            outputs = [s.buffer.take() for s in states]  # everything since the last wake-up
            output = outputs[0] if len(outputs) == 1 else Output.merge(outputs, states[0].buffer.n)
            yield output
            if output.finished:
                return

    # --8<-- [end:wait_for_ack]

    # ---------------------------------------------------------------- operations
    def fail_all(self, error: ErrorInfo) -> None:
        """A worker died: every in-flight request ends now with `error`; new ones get 503."""
        self.backend_error = error
        for state in list(self.states.values()):
            state.buffer.finish(error)
            state.terminal = True  # nobody is left to abort in the backend
            state.event.set()
        for fut in self._queries.values():
            if not fut.done():
                fut.set_exception(RequestFailed(error))

    def end_all(self, error: ErrorInfo) -> None:
        """End every in-flight request with `error` (shutdown); the backend drops them."""
        for state in list(self.states.values()):
            self.end_with_error(state, error)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait until no request is in flight; False if some still are after `timeout`."""
        deadline = asyncio.get_running_loop().time() + timeout
        while self.states:
            if asyncio.get_running_loop().time() >= deadline:
                return False
            await asyncio.sleep(0.05)
        return True

    def check_stalls(self, now: float, timeout: float) -> None:
        """Cancel requests whose client has read nothing for `timeout` s while output waits."""
        for state in list(self.states.values()):
            since = state.sending_since
            if since is not None and now - since > timeout and state.task and not state.stalled:
                logger.warning(
                    "request %s (uid %d): the client read nothing for %.1f s while output "
                    "waited: aborting the request and closing the connection",
                    state.request_id,
                    state.uid,
                    now - since,
                )
                state.stalled = True
                state.task.cancel()

    async def sweep_stalls(self, timeout: float) -> None:
        """Run for the server's life: check for stalled sends a few times per `timeout`."""
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(0.25, timeout / 4))
            self.check_stalls(loop.time(), timeout)

    async def lifecycle(self, timeout: float = 10.0, flush_cache: bool = False) -> Lifecycle:
        """Live per-uid state of all three processes, the workers' asked over ZMQ. The
        scheduler answers between two steps, so the wait covers one long prefill step.
        `flush_cache`: the scheduler empties its prefix cache first if it has no request
        in flight, and reports `flushed_pages` (-1: it had)."""
        if self.backend_error is not None:
            raise RequestFailed(self.backend_error)
        query_id = next(self._query_ids)
        fut: asyncio.Future[LifecycleStateMsg] = asyncio.get_running_loop().create_future()
        self._queries[query_id] = fut
        try:
            self.send_one(LifecycleQueryMsg(query_id, flush_cache))
            reply = await asyncio.wait_for(fut, timeout)
        finally:
            del self._queries[query_id]
        return Lifecycle(self.state(), reply.tokenizer, reply.scheduler)

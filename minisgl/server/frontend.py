"""FrontendManager: the API server's per-uid state, its one listener, and the request scope.

Contract:
- Every request that reaches the backend lives inside `async with frontend.request(...)`:
  entering creates its uid's `RequestState` (a reply buffer and a wake-up event) and sends
  the TokenizeMsg; leaving, on every path, deletes the state, and sends AbortMsg when the
  terminal reply has not come (disconnect, cancellation, an exception, a consumer that
  stopped early). Sends only queue a ZMQ frame: a `finally` sends without awaiting.
- `listen` routes every UserReply to its uid's buffer and sets its event; a late reply is
  dropped, never recreating state; a buffer past `max_pending_bytes` ends its request.
- `wait_for_ack(state)` waits, clears, takes everything pending as one `Output`, yields it.
- Observers (`observe`: the metrics, the timelines, the stall sweeper) hear each request's
  life: received, first output, each reply, each send to its client, how it ended.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import AsyncExitStack, asynccontextmanager, contextmanager
from dataclasses import dataclass, field

import msgspec

from minisgl.message import (
    AbortMsg,
    ErrorInfo,
    ErrorKind,
    FrontendMsg,
    Lifecycle,
    LifecycleQueryMsg,
    LifecycleStateMsg,
    TokenizeMsg,
    TokenizerMsg,
    UserReply,
)
from minisgl.observe import Observers, Outcome, RequestObserver

from .buffer import Output, ReplyBuffer
from .errors import RequestFailed, error_code
from .middleware import client_var, request_id_var
from .shares import FairShares

logger = logging.getLogger(__name__)


# --8<-- [start:request_state]
@dataclass(eq=False)
class RequestState:
    uid: int
    request_id: str = "-"  # the X-Request-Id, for log lines about this request
    buffer: ReplyBuffer = field(default_factory=ReplyBuffer)
    event: asyncio.Event = field(default_factory=asyncio.Event)  # shared within a group
    # the terminal reply (or a local error) is in the buffer: the workers need no abort
    terminal: bool = False
    stalled: bool = False  # cancelled because its client read nothing for too long
    # --8<-- [end:request_state]

    def outcome(self) -> tuple[Outcome, str]:
        """How the request ended: the outcome and its error code."""
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


class FrontendManager:
    def __init__(
        self,
        send: Callable[[list[TokenizerMsg]], None],
        recv: Callable[[], Awaitable[list[FrontendMsg]]],
        max_pending_bytes: int = 1 << 20,
        max_response_bytes: int = 16 << 20,
        report_cached_tokens: bool = True,
        max_concurrent: int = 1 << 30,
        worker_fault: Callable[[], ErrorInfo | None] | None = None,
    ) -> None:
        self._send = send
        self._recv = recv
        self.max_pending_bytes = max_pending_bytes
        self.max_response_bytes = max_response_bytes  # a non-streamed answer, collected
        self.report_cached_tokens = report_cached_tokens  # usage.prompt_tokens_details
        self.max_concurrent = max_concurrent
        self.shares = FairShares(max_concurrent)
        # why a worker process cannot serve now (the supervisor's heartbeats), or None
        self.worker_fault = worker_fault or (lambda: None)
        self.observer = Observers()
        self.draining = False  # set on SIGTERM: finish what runs, take nothing new
        self.uid_counter = itertools.count()
        self.states: dict[int, RequestState] = {}
        self.backend_error: ErrorInfo | None = None  # set when a worker process died
        self._query_ids = itertools.count()
        self._queries: dict[int, asyncio.Future[LifecycleStateMsg]] = {}

    def observe(self, observer: RequestObserver) -> None:
        self.observer.add(observer)

    # ---------------------------------------------------------------- state
    def new_user(self, n: int = 1, event: asyncio.Event | None = None) -> RequestState:
        buffer = ReplyBuffer(n, report_cached=self.report_cached_tokens)
        state = RequestState(next(self.uid_counter), request_id_var.get(), buffer)
        if event is not None:
            state.event = event
        self.states[state.uid] = state
        self.shares.take(state.uid, client_var.get())
        return state

    def forget(self, uid: int) -> None:
        del self.states[uid]
        self.shares.give_back(uid)

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
        # at most max_concurrent in flight, shared fairly between clients (shares.py)
        if (refused := self.shares.refusal(client_var.get())) is not None:
            raise RequestFailed(refused)

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
        try:
            self.send_one(msgspec.structs.replace(make_msg(state.uid), client=client_var.get()))
        except BaseException as exc:  # nothing reached the workers: nothing to abort
            self.forget(state.uid)
            if isinstance(exc, (msgspec.EncodeError, OverflowError, UnicodeEncodeError)):
                message = f"the request cannot be encoded: {exc}"  # e.g. a lone surrogate
                raise RequestFailed(ErrorInfo(ErrorKind.UNENCODABLE_REQUEST, message)) from exc
            raise
        self.observer.received(state)
        try:
            yield state
        finally:
            self.forget(state.uid)
            outcome, code = state.outcome()
            self.observer.ended(state, outcome, code=code)
            if not state.terminal:  # left early: the workers must drop this uid too
                self.send_one(AbortMsg(state.uid))

    # --8<-- [end:request_scope]

    @contextmanager
    def sending(self, state: RequestState) -> Iterator[None]:
        """Around one send of output to the client; the stall sweeper cancels a request
        whose send stays blocked (its client reads nothing)."""
        self.observer.event(state, "sending")
        try:
            yield
        finally:
            self.observer.event(state, "sent")

    # --8<-- [start:listen]
    async def listen(self) -> None:
        while True:
            for msg in await self._recv():
                if not isinstance(msg, UserReply):  # a state answer, or the observers'
                    self._other(msg)
                    continue
                state = self.states.get(msg.uid)
                if state is None or state.terminal:
                    continue  # a late reply: its request is gone or already ended
                if msg.completion_tokens and not state.buffer.completion_tokens:
                    self.observer.first_output(state)
                self.observer.reply(state, msg)
                if state.buffer.append(msg):
                    state.event.set()
                if msg.finished:
                    state.terminal = True
                elif state.buffer.pending_bytes > self.max_pending_bytes:
                    self._fail_slow_client(state)

    # --8<-- [end:listen]

    def _other(self, msg: FrontendMsg) -> None:
        if isinstance(msg, LifecycleStateMsg):
            if (fut := self._queries.get(msg.query_id)) and not fut.done():
                fut.set_result(msg)
        else:
            self.observer.inbox(msg)

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

"""Fakes of the two workers, for GPU-free tests and benchmarks of the parts around them.

`FakeBackend` (a fake tokenizer worker) stands on the far side of the FrontendManager's two channels: `send` records
every message the frontend sends (TokenizeMsg, AbortMsg, LifecycleQueryMsg), and `recv`
hands out whatever the test injected, batch by batch, so a test decides which UserReply
arrives when and in which order. `on_tokenize` lets a test answer each TokenizeMsg
automatically (the HTTP tests do), `on_query` each LifecycleQueryMsg.

`FakeScheduler` stands where the scheduler does, after the tokenizer worker: the per-request
state of a scheduler without a model. `handle(msgs)` takes what a scheduler receives: a
UserMsg starts a request that will generate `max_tokens` tokens (16 when unset), an
AbortBackendMsg ends one (an unknown uid changes nothing), a StateQueryMsg is answered at
once with the live counts as a `SchedulerState` (what /debug/lifecycle shows).
`step(token_id)` is one decode step: a DetokenizeMsg of `token_id` for every running
request, finish_reason "length" on its last, all in one `send` (as the real loop sends a
step). `sample(...)` scripts a step token by token instead, and `late(uid, token_id)` sends
a token whatever the state (one computed before an abort arrived).

`scheduler_state(**counts)` is a scheduler's answer with every count zero but those given,
for tests that script a LifecycleStateMsg.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import msgspec

from minisgl.message import (
    AbortBackendMsg,
    AbortMsg,
    BackendMsg,
    DetokenizeMsg,
    FrontendMsg,
    LifecycleQueryMsg,
    SchedulerState,
    SchedulerStateMsg,
    StateQueryMsg,
    TokenizeMsg,
    TokenizerMsg,
    UserMsg,
)
from minisgl.server.frontend import FrontendManager


def scheduler_state(**counts: int) -> SchedulerState:
    """A scheduler's state with every count zero but `counts`."""
    zero = {f.name: 0 for f in msgspec.structs.fields(SchedulerState) if f.required}
    return SchedulerState(**{**zero, **counts})


class FakeBackend:
    def __init__(self) -> None:
        self.sent: list[TokenizerMsg] = []
        self.queue: asyncio.Queue[list[FrontendMsg]] = asyncio.Queue()
        self.on_tokenize: Callable[[TokenizeMsg], None] | None = None
        self.on_query: Callable[[LifecycleQueryMsg], None] | None = None

    # the two callables the FrontendManager is built with
    def send(self, msgs: list[TokenizerMsg]) -> None:
        self.sent.extend(msgs)
        for msg in msgs:
            if isinstance(msg, TokenizeMsg) and self.on_tokenize is not None:
                self.on_tokenize(msg)
            elif isinstance(msg, LifecycleQueryMsg) and self.on_query is not None:
                self.on_query(msg)

    async def recv(self) -> list[FrontendMsg]:
        return await self.queue.get()

    # what tests use
    def inject(self, *msgs: FrontendMsg) -> None:
        """Deliver `msgs` as one batch (one `recv` result)."""
        self.queue.put_nowait(list(msgs))

    def tokenized(self) -> list[TokenizeMsg]:
        return [m for m in self.sent if isinstance(m, TokenizeMsg)]

    def aborts(self) -> list[int]:
        """The uid of every AbortMsg sent so far, in order (duplicates kept)."""
        return [m.uid for m in self.sent if isinstance(m, AbortMsg)]

    def queries(self) -> list[LifecycleQueryMsg]:
        return [m for m in self.sent if isinstance(m, LifecycleQueryMsg)]


class FakeScheduler:
    DEFAULT_MAX_TOKENS = 16

    def __init__(self, send: Callable[[list[TokenizerMsg]], None]) -> None:
        self.send = send  # to the tokenizer worker
        self.running: dict[int, int] = {}  # uid -> tokens it has still to generate

    def handle(self, msgs: list[BackendMsg]) -> None:
        replies: list[TokenizerMsg] = []
        for msg in msgs:
            if isinstance(msg, UserMsg):
                self.running[msg.uid] = msg.sampling_params.max_tokens or self.DEFAULT_MAX_TOKENS
            elif isinstance(msg, AbortBackendMsg):
                self.running.pop(msg.uid, None)
            elif isinstance(msg, StateQueryMsg):
                replies.append(SchedulerStateMsg(msg.query_id, self.state()))
        if replies:
            self.send(replies)

    def state(self) -> SchedulerState:
        n = len(self.running)
        return scheduler_state(running=n, table_slots_used=n)

    def step(self, token_id: int) -> int:
        """One token for every running request; returns how many were sent."""
        return self.sample(*((uid, token_id, left == 1) for uid, left in self.running.items()))

    def sample(self, *steps: tuple[int, int, bool]) -> int:
        """One step: for each (uid, token_id, last), the token sampled for a running uid;
        `last` ends the request ("length"). All go to the worker as one batch."""
        batch = []
        for uid, token_id, last in steps:
            if uid in self.running:
                batch.append(DetokenizeMsg(uid, token_id, "length" if last else None))
                self.running[uid] -= 1
                if last:
                    del self.running[uid]
        if batch:
            self.send(batch)
        return len(batch)

    def late(self, uid: int, token_id: int) -> None:
        """A token computed before the abort arrived: it is sent all the same."""
        self.send([DetokenizeMsg(uid, token_id)])


def make_frontend(max_pending_bytes: int = 1 << 20) -> tuple[FrontendManager, FakeBackend]:
    backend = FakeBackend()
    return FrontendManager(backend.send, backend.recv, max_pending_bytes), backend


@asynccontextmanager
async def listening(frontend: FrontendManager) -> AsyncIterator[asyncio.Task]:
    """Run `frontend.listen()` as a task for the duration of the block."""
    task = asyncio.create_task(frontend.listen())
    try:
        yield task
    finally:
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass


async def settle(rounds: int = 20) -> None:
    """Let every ready task run until nothing is left to do (no timers involved)."""
    for _ in range(rounds):
        await asyncio.sleep(0)


async def wait_until(cond: Callable[[], bool], timeout: float = 1.0) -> None:
    """Poll `cond` until it holds; fail the test after `timeout` seconds."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.005)

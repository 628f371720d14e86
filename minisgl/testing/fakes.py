"""A fake tokenizer worker for GPU-free frontend tests.

`FakeBackend` stands on the far side of the FrontendManager's two channels: `send` records
every message the frontend sends (TokenizeMsg, AbortMsg, LifecycleQueryMsg), and `recv`
hands out whatever the test injected, batch by batch, so a test decides which UserReply
arrives when and in which order. `on_tokenize` lets a test answer each TokenizeMsg
automatically (the HTTP tests do), `on_query` each LifecycleQueryMsg.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from minisgl.message import AbortMsg, FrontendMsg, LifecycleQueryMsg, TokenizeMsg, TokenizerMsg
from minisgl.server.frontend import FrontendManager


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

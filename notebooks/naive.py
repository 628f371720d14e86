"""BROKEN ON PURPOSE: naive frontend managers, written for contrast with minisgl's.

Nothing here is used by minisgl. Each class reproduces one design the chapter discusses,
with the same two channel callables as `FrontendManager` (`send` takes a list of messages,
`recv` awaits the next batch of UserReply), so a test can feed both from one FakeBackend:

- `EventOnlyManager`: a wake-up event per uid and no list. An event carries no data, so
  the listener can leave only one reply where the consumer will look: a reply that arrives
  before the consumer ran overwrites the previous one, whose text is lost.
- `ListOnlyManager`: a reply list per uid and no event. The consumer cannot be woken, so
  it polls; `polls` and `empty_polls` count how often it looked.
- `RefStyleManager`: the reference's `ack_map` / `event_map` pair. It delivers every reply,
  but it deletes a uid's maps only at the tail of the `wait_for_ack` generator, a line that
  a consumer which breaks after `finished` (or is cancelled, or raises) never reaches, and
  its lists are unbounded. A cancelled stream has the reference's cancel path:
  `stream_with_cancellation` wraps a stream of chunks, awaits `is_disconnected()` before
  each one, and on cancellation schedules `abort_user(uid)` as a task it keeps no reference
  to, then re-raises; `abort_user` sleeps a fixed `ABORT_DELAY` (0.1 s), only then deletes
  the uid's maps and sends AbortMsg, and until then the listener keeps appending that uid's
  replies. It is the only place that sends AbortMsg: a non-streaming request, or a consumer
  that breaks early, never tells the backend.

The quiz (tests/quiz/) imports this same file.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable

from minisgl.message import AbortMsg, UserReply

Recv = Callable[[], Awaitable[list]]

ABORT_DELAY = 0.1  # seconds: the reference's fixed wait before it forgets a cancelled uid


class _Naive:
    def __init__(self, send: Callable[[list], None], recv: Recv) -> None:
        self.send, self.recv = send, recv
        self.uid_counter = 0

    def _next_uid(self) -> int:
        uid = self.uid_counter
        self.uid_counter += 1
        return uid


class EventOnlyManager(_Naive):
    """An event per uid; the event says "something arrived" but cannot hold it."""

    def __init__(self, send, recv: Recv) -> None:
        super().__init__(send, recv)
        self.event_map: dict[int, asyncio.Event] = {}
        self.latest: dict[int, UserReply] = {}  # one slot: all an event alone can hand over

    def new_user(self) -> int:
        uid = self._next_uid()
        self.event_map[uid] = asyncio.Event()
        return uid

    async def listen(self) -> None:
        while True:
            for reply in await self.recv():
                if reply.uid in self.event_map:
                    self.latest[reply.uid] = reply  # overwrites a reply not yet taken
                    self.event_map[reply.uid].set()

    async def wait_for_ack(self, uid: int) -> AsyncIterator[UserReply]:
        event = self.event_map[uid]
        while True:
            await event.wait()
            event.clear()
            reply = self.latest.pop(uid)
            yield reply
            if reply.finished:
                break


class ListOnlyManager(_Naive):
    """A list per uid and no event: the consumer must come back and look, again and again."""

    def __init__(self, send, recv: Recv, poll: Callable[[], Awaitable[None]] | None = None):
        super().__init__(send, recv)
        self.ack_map: dict[int, list[UserReply]] = {}
        self.poll = poll or (lambda: asyncio.sleep(0.01))  # how long the consumer naps
        self.polls = 0
        self.empty_polls = 0

    def new_user(self) -> int:
        uid = self._next_uid()
        self.ack_map[uid] = []
        return uid

    async def listen(self) -> None:
        while True:
            for reply in await self.recv():
                if reply.uid in self.ack_map:
                    self.ack_map[reply.uid].append(reply)

    async def wait_for_ack(self, uid: int) -> AsyncIterator[UserReply]:
        while True:
            await self.poll()  # nobody can wake us: nap, then look
            self.polls += 1
            pending, self.ack_map[uid] = self.ack_map[uid], []
            if not pending:
                self.empty_polls += 1
                continue
            for reply in pending:
                yield reply
            if pending[-1].finished:
                break


class RefStyleManager(_Naive):
    """The reference's ack_map + event_map: cleanup at the generator's tail, and a cancel
    path (`stream_with_cancellation`) that cleans up and aborts 0.1 s later, in another task."""

    def __init__(self, send, recv: Recv) -> None:
        super().__init__(send, recv)
        self.ack_map: dict[int, list[UserReply]] = {}
        self.event_map: dict[int, asyncio.Event] = {}
        self.unread: dict[int, int] = {}  # instrumentation only: bytes not yet yielded

    def new_user(self) -> int:
        uid = self._next_uid()
        self.ack_map[uid] = []
        self.event_map[uid] = asyncio.Event()
        return uid

    def pending_bytes(self, uid: int) -> int:
        """Text of `uid` held here and not yet yielded: in its list, or taken from it by the
        generator. Nothing caps it: it grows as fast as replies come."""
        return self.unread.get(uid, 0)

    async def listen(self) -> None:
        while True:
            for reply in await self.recv():
                if (replies := self.ack_map.get(reply.uid)) is not None:
                    replies.append(reply)
                    n = len(reply.incremental_output.encode())
                    self.unread[reply.uid] = self.unread.get(reply.uid, 0) + n
                    self.event_map[reply.uid].set()

    # --8<-- [start:ref_wait_for_ack]
    async def wait_for_ack(self, uid: int) -> AsyncIterator[UserReply]:
        event = self.event_map[uid]
        finished = False
        while not finished:
            await event.wait()
            event.clear()
            taken, self.ack_map[uid] = self.ack_map[uid], []
            for reply in taken:
                finished = finished or reply.finished
                self.unread[uid] -= len(reply.incremental_output.encode())
                yield reply
        # cleanup at the tail: it runs only when the consumer asks for one more item after
        # `finished`; a consumer that breaks, is cancelled or raises leaves the generator
        # suspended at `yield` above, and closing it there skips these lines too
        del self.ack_map[uid]
        del self.event_map[uid]

    # --8<-- [end:ref_wait_for_ack]

    async def abort_user(self, uid: int) -> None:
        """The reference's cancel: wait a fixed 0.1 s, then forget `uid` and tell the backend.

        During the wait the listener still appends `uid`'s replies to its list."""
        await asyncio.sleep(ABORT_DELAY)
        if uid in self.ack_map:
            del self.ack_map[uid]
        if uid in self.event_map:
            del self.event_map[uid]
        self.unread.pop(uid, None)  # instrumentation, not part of the reference
        self.send([AbortMsg(uid)])

    async def stream_with_cancellation(
        self,
        chunks: AsyncIterable,
        is_disconnected: Callable[[], Awaitable[bool]],
        uid: int,
    ) -> AsyncIterator:
        """Yield from `chunks`, asking `is_disconnected()` before each chunk; a disconnect
        raises CancelledError. On CancelledError (that one, or the web server cancelling the
        task) it schedules `abort_user(uid)` as a separate task, keeps no reference to it,
        and re-raises: the cleanup happens later, in another task, if at all."""
        try:
            async for chunk in chunks:
                if await is_disconnected():
                    raise asyncio.CancelledError
                yield chunk
        except asyncio.CancelledError:
            asyncio.create_task(self.abort_user(uid))  # fire and forget, as the reference does
            raise

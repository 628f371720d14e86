"""ZMQ plumbing shared by the three processes.

Contract:
- `IpcChannels.create()` makes a per-instance directory with mode 0700 (no other local user
  can connect to our sockets and inject messages) and names one inbox socket per process;
  `remove()` deletes it at exit.
- Every process binds a PULL socket for its own inbox and connects PUSH sockets to its
  neighbours' inboxes. One ZMQ frame carries a list of messages of that channel's union.
- Sends never block the caller: the high-water marks are unlimited (admission control
  bounds how much can be in flight) and a send only queues the frame for ZMQ's I/O thread,
  so a send is safe inside `finally` blocks and cleanup paths.
- A frame that does not decode (a bug, or a stray sender) costs only itself: it is logged
  and dropped, and every good frame received with it is still delivered, so no terminal
  reply is ever lost with it.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

import msgspec
import zmq
import zmq.asyncio

from minisgl.utils.codec import Codec

T = TypeVar("T")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IpcChannels:
    root: str
    frontend: str  # the API server's inbox
    tokenizer: str  # the tokenizer worker's inbox
    scheduler: str  # the scheduler's inbox

    @classmethod
    def create(cls) -> IpcChannels:
        root = Path(tempfile.mkdtemp(prefix="minisgl-"))  # created with mode 0700
        root.chmod(0o700)
        return cls(
            str(root),
            f"ipc://{root}/frontend",
            f"ipc://{root}/tokenizer",
            f"ipc://{root}/scheduler",
        )

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _socket(ctx: zmq.Context, kind: int) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)  # never hang at exit on undelivered frames
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    return sock


def _decode_into(msgs: list[T], codec: Codec[T], frame: bytes, inbox: str) -> None:
    """Append the messages of `frame` to `msgs`; a frame that does not decode is dropped."""
    try:
        msgs += codec.decode(frame)
    except (msgspec.DecodeError, msgspec.ValidationError):
        logger.exception("dropped an undecodable frame (%d bytes) at %s", len(frame), inbox)


def _take_waiting(msgs: list[T], sock: zmq.Socket, codec: Codec[T], inbox: str) -> None:
    """Decode every frame already waiting on `sock` into `msgs`, without blocking."""
    while True:
        try:
            frame = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            return
        _decode_into(msgs, codec, frame, inbox)


class PushQueue(Generic[T]):
    """Sends lists of messages to one neighbour's inbox."""

    def __init__(self, addr: str, union: Any, ctx: zmq.Context | None = None) -> None:
        self._sock = _socket(ctx or zmq.Context.instance(), zmq.PUSH)
        self._sock.connect(addr)
        self._codec: Codec[T] = Codec(union)

    # --8<-- [start:push_put]
    def put(self, msgs: list[T]) -> None:
        if msgs:
            self._sock.send(self._codec.encode(msgs), zmq.NOBLOCK)

    # --8<-- [end:push_put]

    def close(self, linger_ms: int = 0) -> None:
        """`linger_ms`: how long frames still queued may take to go out (a process's last)."""
        self._sock.close(linger=linger_ms)


class PullQueue(Generic[T]):
    """This process's inbox, read synchronously (worker processes)."""

    def __init__(self, addr: str, union: Any, ctx: zmq.Context | None = None) -> None:
        self._sock = _socket(ctx or zmq.Context.instance(), zmq.PULL)
        self._sock.bind(addr)
        self._addr = addr
        self._codec: Codec[T] = Codec(union)

    def get(self, timeout_ms: int | None, wake_on: Sequence[int] = ()) -> list[T]:
        """Everything waiting; when nothing is, wait up to `timeout_ms` (None: forever),
        or until one of the file descriptors `wake_on` is readable. May return [] before
        the timeout (only undecodable frames arrived, or `wake_on` woke it)."""
        msgs: list[T] = []
        if wake_on:
            poller = zmq.Poller()
            poller.register(self._sock, zmq.POLLIN)
            for fd in wake_on:
                poller.register(fd, zmq.POLLIN)
            poller.poll(timeout_ms)
            _take_waiting(msgs, self._sock, self._codec, self._addr)
        elif self._sock.poll(timeout_ms):
            _take_waiting(msgs, self._sock, self._codec, self._addr)
        return msgs

    def close(self) -> None:
        self._sock.close()


class AsyncPullQueue(Generic[T]):
    """This process's inbox, read from an asyncio loop (the API server)."""

    def __init__(self, addr: str, union: Any) -> None:
        self._sock = _socket(zmq.asyncio.Context.instance(), zmq.PULL)
        self._sock.bind(addr)
        self._drain = zmq.Socket.shadow(self._sock.underlying)  # the same socket, sync calls
        self._addr = addr
        self._codec: Codec[T] = Codec(union)

    # --8<-- [start:async_pull_get]
    async def get(self) -> list[T]:
        """Wait for a frame, then take every frame already waiting without awaiting again
        (one future per frame costs more than the decode under a stream of replies).
        Returns at least one message: frames that held none are waited past."""
        msgs: list[T] = []
        while not msgs:
            _decode_into(msgs, self._codec, await self._sock.recv(), self._addr)
            _take_waiting(msgs, self._drain, self._codec, self._addr)
        return msgs

    # --8<-- [end:async_pull_get]

    def close(self) -> None:
        self._sock.close()

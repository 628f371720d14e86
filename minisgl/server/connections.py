"""The HTTP connections themselves: how long a client may take to send a request, and how
many connections may be open.

Contract: `GuardedH11Protocol` is uvicorn's h11 protocol with two guards (uvicorn's `http`
setting takes the class; `guarded(read_timeout, max_connections)` binds the two limits):
- a request must arrive whole, headers and body, within `read_timeout` seconds of the
  moment the server starts waiting for it (the connection opened, or the previous
  response ended and the next request's first byte came); otherwise the connection is
  closed. A client that sends half a request line, stops mid-headers, or sends a chunked
  body that never ends holds its connection for at most that long.
- at most `max_connections` connections are open: a new one past the cap first evicts
  the connection that has waited longest for a request (one reading a slow request, or
  idle between requests); only when every connection is serving a request is the new one
  closed instead. So slow or idle connections can never lock out a client that sends its
  request promptly, and file descriptors stay bounded.
- a request body must not come in pathologically small pieces: past TINY_PIECES pieces
  (HTTP chunks, or reads) averaging under TINY_BYTES bytes, the request is answered 400
  (an OpenAI error body, `code: body_too_fragmented`) and the connection closed. Each piece
  costs the parser what a whole read does, so 1 MB sent as 1-byte chunks was seconds of
  the API server's loop; now it costs at most TINY_PIECES pieces' worth.
Idle keep-alive connections are closed by uvicorn's own keep-alive timeout as before.
The guards use uvicorn's internals (the protocol's `connections`, `conn`, `transport`), so
pyproject.toml pins uvicorn to the versions tests/unit/test_connections.py ran against.

`quiet_accept_errors(loop)` rate-limits asyncio's "socket.accept() out of system
resource" reports (one line per 10 s with a count, instead of a traceback per attempt).
"""

from __future__ import annotations

import asyncio
import logging
import time

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger(__name__)

_DONE_READING = (h11.DONE, h11.MUST_CLOSE, h11.CLOSED, h11.ERROR)
# a body in more pieces than this, averaging fewer bytes than that, is refused (a client
# that streams a body writes pieces of kilobytes; a TCP read holds a segment or more)
TINY_PIECES = 1024
TINY_BYTES = 256
_FRAGMENTED = (
    b'{"error":{"message":"the request body came in more than %d pieces averaging under %d '
    b'bytes; send it in larger pieces","type":"invalid_request_error","param":null,'
    b'"code":"body_too_fragmented"}}' % (TINY_PIECES, TINY_BYTES)
)


class GuardedH11Protocol(H11Protocol):
    read_timeout: float = 30.0
    max_connections: int = 4096

    _read_timer: asyncio.TimerHandle | None = None
    _waiting_since: float | None = None  # waiting for (the rest of) a request since then

    _pieces = _piece_bytes = 0  # of the body of the request being read
    _fragmented = False

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._next_event = self.conn.next_event
        self.conn.next_event = self._counted_next_event  # type: ignore[method-assign]
        self._start_waiting()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self.conn.their_state is h11.IDLE:
            # the first bytes of the next request on this connection (an idle keep-alive
            # connection is marked waiting, for eviction, but has no timer until now)
            self._start_waiting()
        super().data_received(data)
        if self.conn.their_state in _DONE_READING:
            self._stop_waiting()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.conn.their_state is h11.IDLE:
            self._waiting_since = time.monotonic()  # idle: may be evicted, not timed out

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_waiting()
        super().connection_lost(exc)

    # ------------------------------------------------------------ the guards
    def _counted_next_event(self):
        event = self._next_event()
        if isinstance(event, h11.Request):
            self._pieces = self._piece_bytes = 0
        elif isinstance(event, h11.Data):
            self._pieces += 1
            self._piece_bytes += len(event.data)
            if self._pieces > TINY_PIECES and self._piece_bytes < TINY_BYTES * self._pieces:
                self._fragmented = True  # uvicorn answers a protocol error with a 400
                raise h11.RemoteProtocolError("request body too fragmented")
        return event

    def send_400_response(self, msg: str) -> None:
        if not self._fragmented:
            return super().send_400_response(msg)
        logger.info("a request body came in tiny pieces: refused")
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(_FRAGMENTED)).encode()),
            (b"connection", b"close"),
        ]
        for event in (
            h11.Response(status_code=400, headers=headers),
            h11.Data(data=_FRAGMENTED),
            h11.EndOfMessage(),
        ):
            self.transport.write(self.conn.send(event))
        self.transport.close()

    def _start_waiting(self) -> None:
        self._stop_waiting()
        self._waiting_since = time.monotonic()
        self._read_timer = self.loop.call_later(self.read_timeout, self._read_timed_out)

    def _stop_waiting(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None
        self._waiting_since = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if not self.transport.is_closing() and self.conn.their_state not in _DONE_READING:
            logger.info(
                "%s: no whole request within %.0f s: connection closed",
                "{}:{}".format(*self.client) if self.client else "a client",
                self.read_timeout,
            )
            self.transport.close()

    def _make_room(self) -> None:
        waiting = [
            c
            for c in self.connections
            if c is not self and getattr(c, "_waiting_since", None) is not None
        ]
        victim = min(waiting, key=lambda c: c._waiting_since, default=None)
        if victim is None:  # every other connection is serving a request: refuse this one
            victim = self
        logger.warning(
            "more than %d connections open: closing %s", self.max_connections,
            "this new one" if victim is self else "the one waiting longest for a request",
        )  # fmt: skip
        victim._stop_waiting()
        victim.transport.close()


def guarded(read_timeout: float, max_connections: int) -> type[GuardedH11Protocol]:
    """The protocol class with these limits, for uvicorn's `http` setting."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"read_timeout": read_timeout, "max_connections": max_connections},
    )


def default_max_connections() -> int:
    """Half the process's file descriptor limit, at most 4096: the rest stays for files,
    pipes and sockets to the workers."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 4096
    return max(16, min(4096, soft // 2))


def quiet_accept_errors(loop: asyncio.AbstractEventLoop, every: float = 10.0) -> None:
    previous = loop.get_exception_handler()
    seen = {"count": 0, "last": 0.0}

    def handler(loop, context) -> None:
        if "socket.accept() out of system resource" not in str(context.get("message", "")):
            if previous is not None:
                previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        seen["count"] += 1
        now = time.monotonic()
        if now - seen["last"] >= every:
            logger.error(
                "accepting connections failed %d time(s) (%s): out of file descriptors? "
                "lower --max-connections or raise the process's limit",
                seen["count"],
                context.get("exception"),
            )
            seen["count"], seen["last"] = 0, now

    loop.set_exception_handler(handler)

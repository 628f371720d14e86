"""The two ways a completion goes back to the client, as plain ASGI callables.

Contract: a route returns `StreamResponse` or `FullResponse`; calling it (Starlette does)
runs the whole request inside one `frontend.request(...)` scope while a second task listens
on the ASGI receive channel. A client that disconnects (streaming or not, before or after
the first byte) cancels the serving task, so the scope exits early and sends AbortMsg.

- Errors known before the first byte (refused prompt, tokenizer failure, dead backend)
  are a JSON error body with a real HTTP status, also for `stream: true`: the stream waits
  for the first output before it sends its headers.
- An error after streaming began is one `data: {"error": ...}` event, then `data: [DONE]`.
- While a chunk is being sent, `state.sending_since` is set; the stall sweeper cancels a
  request whose send has blocked longer than `--client-stall-timeout` (the client reads
  nothing while output waits). The connection is then closed without a final chunk.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from typing import Any

import msgspec
from starlette.responses import Response

from minisgl.message import ErrorInfo, TokenizeMsg

from .frontend import FrontendManager, Refused
from .protocol import SSE_DONE, ChatFormat, error_body

logger = logging.getLogger(__name__)

Send = Callable[[dict[str, Any]], Awaitable[None]]
Receive = Callable[[], Awaitable[dict[str, Any]]]

_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),  # tell reverse proxies not to buffer the stream
]


async def send_json(send: Send, status: int, body: dict[str, Any], headers=()) -> None:
    data = msgspec.json.encode(body)
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [(b"content-type", b"application/json"), *headers],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


def unavailable(message: str) -> ErrorInfo:
    return ErrorInfo(message, status=503, code="backend_unavailable", type="server_error")


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


# --8<-- [start:serve_until_disconnect]
async def serve_until_disconnect(serve: Awaitable[None], receive: Receive) -> bool:
    """Run `serve` until it ends or the client disconnects, whichever comes first;
    return whether the client disconnected first."""
    body = asyncio.ensure_future(serve)
    watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({body, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        disconnected = not body.done()
        if disconnected:
            # the client is gone: cancel the body and let its request scope exit
            # (sending AbortMsg) before this response returns
            body.cancel()
            await asyncio.wait({body})
    if not body.cancelled() and body.exception() is not None:
        raise body.exception()
    return disconnected


# --8<-- [end:serve_until_disconnect]


class _CompletionResponse(Response):
    """A Starlette Response only so that FastAPI passes it through untouched."""

    def __init__(
        self, frontend: FrontendManager, make_msg: Callable[[int], TokenizeMsg], fmt: ChatFormat
    ) -> None:
        self.frontend, self.make_msg, self.fmt = frontend, make_msg, fmt
        self.background = None

    async def __call__(self, scope, receive: Receive, send: Send) -> None:
        disconnected = await serve_until_disconnect(self._serve_or_refuse(send), receive)
        if disconnected and self.frontend.metrics is not None:
            self.frontend.metrics.on_disconnect()

    async def _serve_or_refuse(self, send: Send) -> None:
        try:
            await self.serve(send)
        except Refused as refused:
            if self.frontend.metrics is not None:
                self.frontend.metrics.on_rejected(refused.error.code or "refused")
            headers = []
            if refused.retry_after is not None:
                headers.append((b"retry-after", str(refused.retry_after).encode()))
            await send_json(send, refused.error.status, error_body(refused.error), headers)

    async def serve(self, send: Send) -> None:
        raise NotImplementedError


class FullResponse(_CompletionResponse):
    """Non-streaming: collect the whole output, then one JSON body."""

    async def serve(self, send: Send) -> None:
        async with self.frontend.request(self.make_msg) as state:
            pieces: list[str] = []
            async with aclosing(self.frontend.wait_for_ack(state)) as outputs:
                async for out in outputs:
                    pieces.append(out.text)
            if out.error is not None:
                await send_json(send, out.error.status, error_body(out.error))
                return
            body = self.fmt.completion(
                "".join(pieces), out.finish_reason, out.prompt_tokens, out.completion_tokens
            )
            await send_json(send, 200, body)


class StreamResponse(_CompletionResponse):
    """Streaming: SSE chunks as output arrives, headers only once the first output is in."""

    # --8<-- [start:stream_serve]
    async def serve(self, send: Send) -> None:
        loop = asyncio.get_running_loop()
        async with self.frontend.request(self.make_msg) as state:
            state.task = asyncio.current_task()
            async with aclosing(self.frontend.wait_for_ack(state)) as outputs:
                out = await anext(outputs)
                if out.error is not None:  # nothing sent yet: a real HTTP status
                    await send_json(send, out.error.status, error_body(out.error))
                    return
                await send({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})
                first = True
                while True:
                    body = self.fmt.stream_chunks(out.text, first, out.finish_reason, out.error)
                    first = False
                    if out.finished:
                        body += SSE_DONE
                    state.sending_since = loop.time()
                    await send(
                        {"type": "http.response.body", "body": body, "more_body": not out.finished}
                    )
                    state.sending_since = None
                    if out.finished:
                        return
                    out = await anext(outputs)

    # --8<-- [end:stream_serve]
